"""The engine and the transformers runner at their edges: a forward that raises gives its slots back, leaks are
caught by `check_integrity`, bad requests and options are refused with typed errors before anything changes.

Most tests run the engine over `hwkv.engine.synthetic.SyntheticModel` (no weights: fast); the runner's own
refusals use a tiny Gemma-2 made from its config.
"""
from __future__ import annotations

from typing import Dict, List, Optional

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
from hwkv.errors import ConfigError, DeviceError, HwkvError
from hwkv.graph import EagerAdapter

VOCAB = 97
CPU = torch.device("cpu")
SHAPE = ModelShape(name="tiny", layer_is_swa=layer_pattern(4, "sf"), window=8, num_heads=4, num_kv_heads=2,
                   head_dim=16, swa_sinks=True, logit_cap=30.0, dtype_bytes=4)
FULL = ModelShape(name="tiny-full", layer_is_swa=layer_pattern(2, "f"), window=8, num_heads=4, num_kv_heads=2,
                  head_dim=16, dtype_bytes=4)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


class Flaky:
    """The model, raising `exc` on the next call once armed (after running the layers: their K/V are written)."""

    def __init__(self, model: SyntheticModel) -> None:
        self.model, self.exc = model, None

    def __call__(self, batch, ids, pos, keep):
        out = self.model(batch, ids, pos, keep)
        exc, self.exc = self.exc, None
        if exc is not None:
            raise exc
        return out


def _engine(shape=SHAPE, page_size=4, prefix_cache=True, overlap=False, graphs=None, whole_step=None, draft=None,
            graph_batch_sizes=None, max_running=4, chunk=24):
    plan = plan_pools(shape, context=96, max_running=max_running, chunk=chunk, page_size=page_size, memory=None,
                      device=CPU, prefix_cache=prefix_cache)
    cache = build_cache(shape, plan, torch.float32, CPU, backend_device="cpu")
    model = Flaky(SyntheticModel(shape, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                                 positions=cache.rtt.max_context_len, seed=3))
    engine = Engine(cache, model, stats=RunnerStats(shape, plan), vocab_size=VOCAB,
                    window=shape.window if any(shape.layer_is_swa) else None,
                    prefix_cache=prefix_cache, overlap=overlap, graph_adapter=graphs,
                    graph_choice="eager" if graphs is not None else "off", whole_step=whole_step, draft=draft,
                    graph_batch_sizes=graph_batch_sizes)
    return engine, model


def _prompts(n=3, system=13, user=7, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    head = torch.randint(0, VOCAB, (system,), generator=g).tolist()
    return [head + torch.randint(0, VOCAB, (user + 5 * i,), generator=g).tolist() for i in range(n)]


def _state(e: Engine) -> Dict[str, object]:
    """What the pools hold and each running request's row, length and frontier (a failed step leaves them)."""
    a = e.cache.allocator
    s = {"held": e.cache.held_slots(), "full": (a.pages.refs >= 1).clone(),
         "rows": {r.rid: (r.kv_len, r.pending, len(r.output), e.cache.rtt.req_to_token[r.row, :r.kv_len].clone(),
                          int(e.slots.frontiers_cpu[r.row]), int(e.slots.frontiers[r.row]))
                  for r in e.scheduler.running}}
    if e.cache.hybrid:
        s["swa"] = (a.swa_attn_allocator.pages.refs >= 1).clone()
        s["map"] = a.full_to_swa_index_mapping.clone()
    if e.prefix is not None:
        s["cache"] = (e.prefix.full_tokens, e.prefix.swa_tokens, e.prefix.evictable_full, e.prefix.evictable_swa)
    return s


def _same(a: Dict[str, object], b: Dict[str, object]) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, tuple):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        return x == y
    return eq(a, b)


def _run(e: Engine, model: Optional[Flaky], prompts, new=10, exc=None) -> List[List[int]]:
    """Every prompt to the end; with `exc`, each step first fails once (the model raises it after its layers) and
    must leave the pools and rows as they were, then runs."""
    out = {}
    rids = [e.add_request(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    while e.has_work():
        if exc is not None and not e.scheduler.waiting and any(r.decodes or r.prefilling for r in e.scheduler.running):
            before = _state(e)
            model.exc = exc
            with pytest.raises(type(exc)):
                e.step()
            e.check_integrity()
            assert _same(_state(e), before), "a failed step changed the pools or the rows"
        for r in e.step():
            out[r.rid] = r.tokens
        e.check_integrity()
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)
    return [out[r] for r in rids]


# ---------------------------------------------------------------------------------- a forward that raises
CASES = {
    "eager": dict(),
    "eager-no-cache": dict(prefix_cache=False),
    "eager-overlap": dict(overlap=True),
    "eager-page-1": dict(page_size=1),
    "full-attention": dict(shape=FULL, prefix_cache=False),
    "layers-graph": dict(graphs=EagerAdapter(), whole_step=False),
    "whole-step": dict(graphs=EagerAdapter(), whole_step=True, overlap=True),
    "whole-step-beyond-buckets": dict(graphs=EagerAdapter(), whole_step=True, graph_batch_sizes=[1]),
    "verify": dict(draft=prompt_lookup()),
    "verify-graph": dict(draft=prompt_lookup(), graphs=EagerAdapter(), whole_step=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_whose_forward_raises_gives_back_what_it_allocated(case):
    """Every step fails once before it runs (prefill chunks, mixed, decode steps opening and continuing pages,
    verify steps, graph replays): nothing it allocated stays held, rows and frontiers are as before, and the run
    then gives the tokens of a run that never failed."""
    kw = CASES[case]
    prompts = _prompts()
    if "draft" in kw:  # repeats for the drafter to find
        prompts = [p + p[:9] for p in prompts]
    want = _run(*_engine(**kw), prompts)
    exc = KeyboardInterrupt() if case.endswith("overlap") else RuntimeError("the model failed")
    assert _run(*_engine(**kw), prompts, exc=exc) == want


@pytest.mark.parametrize("overlap", [True, False])
def test_ctrl_c_in_the_read_back_loses_no_forward(overlap):
    """Ctrl-C in a step's wait for the device (the read-back of a forward in flight): that forward, and with overlap
    the one just issued, stay in flight; the next steps read them and the run gives an uninterrupted run's tokens
    (a lost forward had left its requests pending for ever)."""
    prompts = _prompts()
    want = _run(*_engine(overlap=overlap), prompts)
    e, _ = _engine(overlap=overlap)
    rids = [e.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    read, out, interrupts = e.readback.read_oldest, {}, 0

    def interrupted():  # in the wait for the oldest forward's copy, before it leaves the list
        raise KeyboardInterrupt()

    for n in range(200):
        if not e.has_work():
            break
        e.readback.read_oldest = interrupted if n % 3 == 2 else read  # every third step's wait is interrupted
        try:
            finished = e.step()
        except KeyboardInterrupt:
            interrupts += 1
            continue
        finally:
            e.readback.read_oldest = read
        out.update((r.rid, r.tokens) for r in finished)
        e.check_integrity()
    assert interrupts and not e.has_work() and [out[r] for r in rids] == want
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


def test_check_integrity_finds_slots_nobody_holds():
    """Pages the allocator holds must be the running requests' (their rows up to their lengths) or the prefix
    cache's: one taken and never given to anyone is a leak."""
    for kw in (dict(), dict(prefix_cache=False), dict(shape=FULL, prefix_cache=False)):
        e, _ = _engine(**kw)
        e.add_request(_prompts(1)[0], SamplingParams(max_new_tokens=4))
        e.step()
        e.check_integrity()
        with torch.inference_mode():
            e.cache.allocator.alloc(e.cache.plan.page_size)
        with pytest.raises(AssertionError, match="leak"):
            e.check_integrity()


def test_check_integrity_finds_a_swa_reference_nobody_holds():
    e, _ = _engine(prefix_cache=False)
    e.add_request(_prompts(1)[0], SamplingParams(max_new_tokens=4))
    e.step()
    req = e.scheduler.running[0]
    with torch.inference_mode():
        e.cache.allocator.share(e.cache.rtt.req_to_token[req.row, req.kv_len - 1:req.kv_len])
    with pytest.raises(AssertionError, match="leak"):
        e.check_integrity()


# ---------------------------------------------------------------------------------- bad requests
def _snapshot(e: Engine):
    return (e.cache.allocator.integrity_snapshot(), e.cache.rtt.req_to_token.clone(), list(e.cache.rtt._free),
            len(e.scheduler.waiting), len(e.scheduler.running), e._next_rid, dict(e.requests))


def _unchanged(a, b) -> bool:
    from hwkv.allocator import same_snapshot

    return same_snapshot(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:]


@pytest.mark.parametrize("prompt, message", [
    (None, "a prompt must be a sequence of token ids .*got NoneType None"),
    (5, "a prompt must be a sequence of token ids .*got int 5"),
    ("abc", "got str 'abc': tokenize text first"),
    (b"ab", "got bytes"),
    ([1.7, 2.9, 3.5], r"prompt token id 1.7 \(float, at index 0\) is not an integer"),
    ([1, True], r"prompt token id True \(bool, at index 1\) is not an integer"),
    ([1, "2"], r"prompt token id '2' \(str, at index 1\) is not an integer"),
    ([1, None], r"prompt token id None \(NoneType, at index 1\)"),
    (np.array([1.0, 2.0]), "a prompt array must hold integers, got float64"),
    (torch.tensor([1.0, 2.0]), "a prompt tensor must hold integers, got torch.float32"),
    (torch.tensor([True]), "a prompt tensor must hold integers, got torch.bool"),
    (torch.tensor([[1, 2]]), r"a prompt must be 1-D, got shape \[1, 2\]"),
])
def test_bad_prompts_are_refused_with_typed_errors_and_nothing_queued(prompt, message):
    e, _ = _engine()
    e.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    e.step()
    before = _snapshot(e)
    with pytest.raises(ConfigError, match=message):
        e.add_request(prompt)
    assert _unchanged(_snapshot(e), before)


@pytest.mark.parametrize("prompts, params, message", [
    (["abc"], SamplingParams(), "got str 'abc'"),
    ([[1, 2], [1.5]], SamplingParams(), r"prompt 1: prompt token id 1.5 \(float, at index 0\)"),
    ([[1]], {"max_new_tokens": 2}, r"params must be a SamplingParams or one per prompt, got dict"),
    ([[1], [2]], [SamplingParams(), "x"], r"params\[1\] must be a SamplingParams, got str 'x'"),
    ([[1]], None, "params must be a SamplingParams or one per prompt, got NoneType"),
    (None, SamplingParams(), "prompts must be a sequence of prompts, got NoneType"),
    ("abc", SamplingParams(), "prompts must be a sequence of prompts, got str"),
])
def test_generate_refuses_malformed_prompts_and_params_before_queueing_any(prompts, params, message):
    e, _ = _engine()
    before = _snapshot(e)
    with pytest.raises(ConfigError, match=message):
        e.generate(prompts, params)
    assert _unchanged(_snapshot(e), before)
    with pytest.raises(ConfigError, match=r"params must be a SamplingParams, got dict"):
        e.add_request([1, 2], {"max_new_tokens": 2})
    assert _unchanged(_snapshot(e), before)
    # every integer form of a prompt still runs, alike
    p = [5, 7, 11, 13, 17]
    forms = [p, tuple(p), [np.int64(t) for t in p], np.array(p, dtype=np.int32), torch.tensor(p), range(5, 6)]
    out = e.generate(forms, SamplingParams(max_new_tokens=3))
    assert all(r.prompt == p and r.tokens == out[0].tokens for r in out[:5]) and out[5].prompt == [5]
    assert all(type(t) is int for r in out for t in r.prompt)
    # a value outside the vocabulary is still reported in that prompt's Result, the others run
    res = e.generate([[1, 2], [1, 500]], SamplingParams(max_new_tokens=2))
    assert res[0].error is None and isinstance(res[1].error, ConfigError)


@pytest.mark.parametrize("sizes", [[2.5], ["a"], [True], [0], [-2], [1, 0]])
@pytest.mark.parametrize("whole_step", [True, False])
def test_graph_batch_sizes_must_be_integers_of_at_least_one(sizes, whole_step):
    with pytest.raises(ConfigError, match=r"graph_batch_sizes must be integers >= 1 \(a list, tuple or set\), got \["):
        _engine(graphs=EagerAdapter(), whole_step=whole_step, graph_batch_sizes=sizes)
    for fine in ((np.int64(2),), {2}, (b for b in [2])):  # any iterable of integers, as before
        e, _ = _engine(graphs=EagerAdapter(), whole_step=whole_step, graph_batch_sizes=fine)
        assert e.graph.buckets == [2, 4]


def test_a_prompt_may_be_any_iterable_of_integers():
    e, _ = _engine()
    for prompt in ((t for t in [5, 6, 7]), range(5, 8), np.array([5, 6, 7], dtype=np.int32), torch.tensor([5, 6, 7])):
        rid = e.add_request(prompt, SamplingParams(max_new_tokens=1))
        assert e.scheduler.waiting[-1].rid == rid and e.scheduler.waiting[-1].prompt == [5, 6, 7]


# ---------------------------------------------------------------------------------- the transformers runner
@pytest.fixture(scope="module")
def tiny_gemma2(tiny_gemma2_config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_gemma2_config(), dtype=torch.float32,
                                                          attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def saved_gemma2(tiny_gemma2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gemma2")
    tiny_gemma2.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kw", [dict(graphs="bogus"), dict(graph_batch_sizes=[2.5], graphs="eager")])
def test_a_refused_runner_leaves_the_models_attention_as_it_was(tiny_gemma2, kw):
    from hwkv.integrations.transformers import HybridRunner

    try:
        with pytest.raises(ConfigError):
            HybridRunner(tiny_gemma2, **kw)
        assert tiny_gemma2.config._attn_implementation == "eager"
        tiny_gemma2(torch.tensor([[1, 2, 3]]))  # the model runs on its own
    finally:
        tiny_gemma2.set_attn_implementation("eager")


def test_a_closed_runner_refuses_requests_at_add_request(tiny_gemma2):
    from hwkv.integrations.transformers import HybridRunner

    with HybridRunner(tiny_gemma2, context=16, max_running=2) as r:
        r.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    for call in (lambda: r.add_request([1, 2]), lambda: r.generate([[1, 2]]), r.step):
        with pytest.raises(ConfigError, match="this HybridRunner is closed"):
            call()
    assert not r.scheduler.waiting and not r.requests and r._next_rid == 1


def test_a_model_raising_in_training_mode_leaks_nothing(tiny_gemma2):
    """The reviewer's case: dropout in training mode makes hwkv's attention raise mid-step."""
    from hwkv.integrations.transformers import HybridRunner

    for m in tiny_gemma2.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    try:
        for prefix_cache in (True, False):
            with HybridRunner(tiny_gemma2, context=32, prefix_cache=prefix_cache) as r:
                tiny_gemma2.train()
                with pytest.raises(HwkvError):
                    r.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=4))
                tiny_gemma2.eval()
                r.check_integrity()
                while r.has_work():
                    r.step()
                r.check_integrity()
                r.clear_prefix_cache()
                assert r.cache.held_slots() == (0, 0)
    finally:
        tiny_gemma2.eval()
        for m in tiny_gemma2.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.0


def test_load_model_raises_typed_errors_chained_to_the_cause(saved_gemma2, tmp_path):
    from hwkv.integrations.transformers import load_model

    with pytest.raises(ConfigError, match="cannot load model '/nonexistent/model': no such folder") as e:
        load_model("/nonexistent/model")
    assert e.value.__cause__ is not None
    with pytest.raises(DeviceError, match="device='bogus' is not a torch device") as e:
        load_model(saved_gemma2, device="bogus")
    assert e.value.__cause__ is not None
    with pytest.raises(ConfigError, match=r"dtype=torch.int8 is not a floating-point dtype"):
        load_model(saved_gemma2, dtype=torch.int8)
    with pytest.raises(ConfigError, match=r"dtype=5 .*choose one of fp32, bf16, fp16 or a floating torch dtype"):
        load_model(saved_gemma2, dtype=5)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=f"cannot load model '{tmp_path}': ") as e:
        load_model(str(tmp_path))
    assert e.value.__cause__ is not None
    assert load_model(saved_gemma2, dtype=torch.bfloat16).dtype == torch.bfloat16
