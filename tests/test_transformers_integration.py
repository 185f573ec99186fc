"""Hugging Face models through hwkv (`hwkv.integrations.transformers`, `hwkv generate`), on tiny random models.

Each architecture is saved with `save_pretrained` and loaded back in fp32; greedy tokens of prompts longer
than the window, added at different steps, must equal transformers' own `generate()` token for token.
Weights are drawn with initializer_range 0.3 and untied embeddings, so attention is far from uniform and the
output is not an echo of the input token (Gemma's scaled, tied embeddings do that): while writing these tests,
every prompt's greedy output changed when the window was ignored, and most changed when the softmax scale was
multiplied by 1.3. Every reference step must be decisive (`hf_greedy` checks its top-2 logit gap), so equality
is not decided by float rounding.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")

from hwkv import cli  # noqa: E402
from hwkv.errors import ConfigError, OutOfSlotsError  # noqa: E402
from hwkv.engine import pools  # noqa: E402
from hwkv.integrations import hf_model  # noqa: E402
from hwkv.integrations.hf_model import layer_kinds, model_shape, plan_pools  # noqa: E402
from hwkv.integrations.sampling import SamplingParams, sample  # noqa: E402
from hwkv.integrations.transformers import HybridRunner, load_model  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
              tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine: the CUDA backend and graphs


def _configs() -> Dict[str, object]:
    t = transformers
    cfgs = {
        "gpt_oss": t.GptOssConfig(**COMMON, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                  rope_parameters=ROPE),  # sinks on every layer, [s, f, s, f]
        "gemma2": t.Gemma2Config(**COMMON, sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0),
        "gemma3": t.Gemma3TextConfig(**COMMON, sliding_window=12, query_pre_attn_scalar=24,
                                     layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                  "sliding_attention"]),
        "cohere2": t.Cohere2Config(**COMMON, sliding_window=8, logit_scale=1.0),  # [s, s, s, f], no RoPE on full
        "mistral": t.MistralConfig(**COMMON, sliding_window=10),  # every layer slides
        "mistral_full": t.MistralConfig(**COMMON, sliding_window=None),  # no SWA layer: one MHA pool
    }
    if hasattr(t, "MiMoV2FlashConfig"):  # the transformers versions with a MiMo-V2-Flash model (5.24 has one)
        # [f, s, s, s]; K head_dim 24, V head_dim 8; SWA layers have 2 x the KV heads (4) and sinks, full ones 2
        cfgs["mimo_v2"] = t.MiMoV2FlashConfig(**{**COMMON, "head_dim": 24}, v_head_dim=8, sliding_window=9,
                                              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2)
    return cfgs


ARCHS = list(_configs())
PROMPT_LENS = (3, 11, 20, 29)
NEW = 12
WEIGHT_SEED = 2     # with these configs every reference step's top-2 gap exceeds MIN_GAP
MIN_GAP = 1e-3      # 50x the largest fp32 logit difference measured between hwkv and the eager forward (2e-5)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Dict[str, Path]:
    """Every tiny model, saved and ready to load back."""
    out = {}
    for name, cfg in _configs().items():
        torch.manual_seed(WEIGHT_SEED)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
    return out


@pytest.fixture(scope="module")
def prompts() -> List[List[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _load(path: Path):
    return load_model(str(path), device=DEVICE, dtype="fp32", attn_implementation="eager")


def hf_greedy(model, prompts: List[List[int]], new: int = NEW) -> List[List[int]]:
    """transformers' own generate(), one prompt at a time (no padding: an explicit all-ones mask, or generate
    would mask every prompt token equal to pad_token_id), greedy; every step's top-2 gap must be >= MIN_GAP."""
    out = []
    for p in prompts:
        gen = model.generate(torch.tensor([p], device=model.device),
                             attention_mask=torch.ones(1, len(p), dtype=torch.int64, device=model.device),
                             max_new_tokens=new, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        gap = min(float(top[0] - top[1]) for top in (lg[0].topk(2).values for lg in gen.logits))
        assert gap >= MIN_GAP, f"the reference is nearly tied (top-2 gap {gap:.1e}): pick other weights"
        out.append(gen.sequences[0, len(p):].tolist())
    return out


def run_staggered(runner: HybridRunner, prompts, params, add_at=(0, 0, 2, 5)) -> Dict[int, List[int]]:
    """Add prompt i before step add_at[i]; step to the end, checking integrity after every step."""
    rids, out, step = {}, {}, 0
    while len(rids) < len(prompts) or runner.has_work():
        for i, at in enumerate(add_at):
            if at == step and i not in rids:
                rids[i] = runner.add_request(prompts[i], params)
        for res in runner.step():
            out[res.rid] = res.tokens
        runner.check_integrity()
        assert len(runner.scheduler.running) <= runner.cache.plan.max_running
        step += 1
    return {i: out[rid] for i, rid in rids.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, saved, prompts):
    model = _load(saved[arch])
    want = hf_greedy(model, prompts)
    with HybridRunner(model, max_running=3, chunk=8, page_size=4, context=48) as runner:
        got = run_staggered(runner, prompts, SamplingParams(max_new_tokens=NEW))
        assert runner.cache.hybrid == (arch != "mistral_full")
        assert runner.stats.forwards["MIXED"] > 0 and runner.stats.forwards["DECODE"] > 0
        held = runner.cache.held_slots()  # what finished requests left is the prefix cache's alone
        assert held == (runner.prefix.full_tokens, runner.prefix.swa_tokens) if runner.prefix else held == (0, 0)
        runner.clear_prefix_cache()
        assert runner.cache.held_slots() == (0, 0)  # every finished request gave its slots back
        assert runner.stats.peak_held_bytes > 0
    assert [got[i] for i in range(len(prompts))] == want
    assert model.config._attn_implementation == "eager"  # restored by close()


@pytest.mark.parametrize("arch,page_size,graphs,chunk", [("gpt_oss", 1, "eager", 16), ("gemma2", 16, "eager", 16),
                                                         ("gemma3", 4, "eager", 1), ("mistral", 16, "off", 16),
                                                         ("cohere2", 1, "off", 3)])
def test_pages_and_graph_decode(arch, page_size, graphs, chunk, saved, prompts):
    """Page sizes 1, < W and > W; decode through the graph runner's static buffers (EagerAdapter); chunk=1
    puts one-token prompt chunks that do not sample into decode forwards."""
    model = _load(saved[arch])
    want = hf_greedy(model, prompts)
    with HybridRunner(model, max_running=4, chunk=chunk, page_size=page_size, context=48, graphs=graphs) as runner:
        got = runner.generate(prompts, SamplingParams(max_new_tokens=NEW))
        runner.check_integrity()
        replays = runner.stats.graph_replays
    assert [r.tokens for r in got] == want
    assert (replays > 0) == (graphs == "eager")


@pytest.mark.parametrize("arch,page_size,overlap", [("gpt_oss", 1, True), ("gemma2", 16, False), ("cohere2", 4, True)])
def test_whole_step_graph_decode_equals_the_layers_graph(arch, page_size, overlap, saved, prompts):
    """Decode steps as one graph each (allocation, req_to_token, metadata, layers, release inside: the
    DecodeStepGraph) give the tokens the layers-only graph and transformers give, with the prefix cache serving
    the second round; the pools end as consistent."""
    from hwkv.step_graph import DecodeStepGraph

    model = _load(saved[arch])
    want = hf_greedy(model, prompts)
    got = {}
    for whole in (True, False):
        with HybridRunner(model, max_running=4, chunk=16, page_size=page_size, context=48, graphs="eager",
                          whole_step=whole, overlap=overlap) as runner:
            assert runner.whole_step is whole and isinstance(runner.graph, DecodeStepGraph) is whole
            rounds = [runner.generate(prompts, SamplingParams(max_new_tokens=NEW)) for _ in range(2)]
            runner.check_integrity()
            assert runner.stats.graph_replays > 0
            if runner.prefix is not None:
                assert runner.stats.reused_tokens > 0
        got[whole] = [[r.tokens for r in res] for res in rounds]
    assert got[True] == got[False] == [want, want]


# ---- speculative verify: drafts checked in one forward, tokens always greedy decoding's ------------------------
def _oracle(prompts, want, wrong_at=None):
    """A drafter that knows each prompt's greedy continuation (`wrong_at`: that draft position is corrupted)."""
    def draft(tokens, k):
        for p, w in zip(prompts, want):
            if tokens[:len(p)] == p:
                d = list(w[len(tokens) - len(p):len(tokens) - len(p) + k])
                if wrong_at is not None and len(d) > wrong_at:
                    d[wrong_at] = (d[wrong_at] + 1) % 128
                return d
        raise AssertionError("the drafter got a sequence of no prompt")
    return draft


@pytest.mark.parametrize("arch,page_size,wrong_at,graphs", [
    ("gpt_oss", 1, None, "off"), ("gemma2", 16, 2, "off"), ("cohere2", 4, 1, "off"), ("gemma3", 16, None, "off"),
    ("gpt_oss", 1, 1, "eager"), ("gemma2", 16, None, "eager")])
def test_speculative_verify_keeps_greedy_tokens(arch, page_size, wrong_at, graphs, saved, prompts):
    """Drafts verified in one forward: the tokens equal transformers' greedy ones whatever the drafts (all right,
    one wrong at a position), fewer forwards when they are right, pools consistent after every step, and the
    prefix cache serves a second round. With graphs, verify steps of num_draft drafts replay a VerifyStepGraph
    (allocation, req_to_token, metadata and layers in the replay) and decode steps the whole-step graph."""
    model = _load(saved[arch])
    want = hf_greedy(model, prompts)
    with HybridRunner(model, max_running=4, chunk=32, page_size=page_size, context=48, graphs=graphs,
                      draft=_oracle(prompts, want, wrong_at), num_draft=4) as runner:
        assert (runner.verify_graph is not None) == (graphs != "off")
        for _ in range(2):
            rids = [runner.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in prompts]
            got = {}
            while runner.has_work():
                got.update({r.rid: r.tokens for r in runner.step()})
                runner.check_integrity()
            assert [got[r] for r in rids] == want
        st = runner.stats
        verifies = st.forwards["TARGET_VERIFY"]
        assert verifies > 0 and st.draft_tokens > 0
        if wrong_at is None:
            assert st.accepted_tokens == st.draft_tokens  # every draft right: every one kept
            assert st.generated_tokens == 2 * len(prompts) * NEW
            assert st.forwards["DECODE"] + verifies < 2 * NEW  # fewer forwards than one per token
        else:
            assert 0 < st.accepted_tokens < st.draft_tokens
        assert "accepted" in st.draft_line()
        if graphs != "off":  # most verifies replayed the graph (the last drafts of a request are shorter)
            assert runner.verify_graph.replays > verifies // 2


def test_speculative_verify_with_wrong_drafts_stops_and_sampling(saved, prompts):
    """Drafts that are always wrong change nothing; a stop token inside an accepted run ends the request there,
    as it does without drafts; a request that samples (temperature > 0) never speculates and draws the same
    stream as without a drafter."""
    model = _load(saved["gemma2"])
    want = hf_greedy(model, prompts)
    g = torch.Generator().manual_seed(3)

    def wrong(tokens, k):
        return [int(t) for t in torch.randint(0, 128, (k,), generator=g)]

    stop = SamplingParams(max_new_tokens=NEW, stop_token_ids=(want[0][5],))
    hot = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=7)
    with HybridRunner(model, max_running=4, chunk=32, page_size=4, context=48) as plain:
        ref_stop = plain.generate(prompts[:1], stop)[0]
        ref_hot = plain.generate(prompts[:1], hot)[0]
    with HybridRunner(model, max_running=4, chunk=32, page_size=4, context=48, draft=wrong) as runner:
        assert [r.tokens for r in runner.generate(prompts, SamplingParams(max_new_tokens=NEW))] == want
        runner.check_integrity()
        assert runner.stats.draft_tokens > 0
    with HybridRunner(model, max_running=4, chunk=32, page_size=4, context=48,
                      draft=_oracle(prompts, want)) as runner:
        got = runner.generate(prompts[:1], stop)[0]
        assert (got.tokens, got.finish_reason) == (ref_stop.tokens, ref_stop.finish_reason) == (want[0][:6], "stop")
        drafted = runner.stats.draft_tokens
        assert drafted > 0
        assert runner.generate(prompts[:1], hot)[0].tokens == ref_hot.tokens
        assert runner.stats.draft_tokens == drafted  # sampling requests are not drafted for
        runner.check_integrity()


def test_speculative_verify_refusals(saved, prompts):
    """A drafter that is not callable, num_draft < 1, or drafts outside the vocabulary: typed errors."""
    model = _load(saved["gemma2"])
    for bad in (dict(draft=3), dict(draft=lambda t, k: [], num_draft=0)):
        with pytest.raises(ConfigError, match="speculative verify needs"):
            HybridRunner(model, max_running=2, context=48, **bad)
    with HybridRunner(model, max_running=2, context=48, draft=lambda t, k: [10 ** 6] * k) as runner:
        with pytest.raises(ConfigError, match="drafter proposed token id 1000000"):
            runner.generate(prompts[:1], SamplingParams(max_new_tokens=4))


def test_prompt_lookup_drafter():
    from hwkv.engine.drafters import prompt_lookup

    d = prompt_lookup(max_ngram=2)
    assert d([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]      # the 2-gram (5, 6) recurs: what followed it
    assert d([1, 2, 3, 9, 3], 2) == [9, 3]              # no 2-gram: the 1-gram (3) at its latest earlier place
    assert d([1, 2, 3, 4], 2) == []                     # nothing recurs
    with pytest.raises(ConfigError, match="min_ngram"):
        prompt_lookup(max_ngram=0)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's compiled replay with torch page ops is the case refused")
def test_whole_step_graph_needs_page_ops_or_eager_replay(saved):
    """whole_step=True where the allocation cannot run inside the graph (the CPU's compiled replay, torch page
    ops): a ConfigError naming the way out, and the model keeps its own attention."""
    model = _load(saved["gemma2"])
    with pytest.raises(ConfigError, match="whole_step=True.*graphs='eager'"):
        HybridRunner(model, max_running=2, context=48, graphs="on", whole_step=True)
    assert model.config._attn_implementation == "eager"


def test_device_graph_adapter_decode(saved, prompts):
    """graphs="on": the device's own adapter (on the CPU torch.compile over the static buffers, CUDA graphs on
    NVIDIA)."""
    from torch._dynamo.utils import counters

    from hwkv_cpu.graph import CompileGraphAdapter

    model = _load(saved["cohere2"])
    want = hf_greedy(model, prompts[:2])
    counters.clear()
    with HybridRunner(model, max_running=2, chunk=32, context=48, graphs="on", graph_batch_sizes=[1, 2]) as runner:
        assert type(runner.graph.adapter) is runner.spec.load_graph_adapter()
        got = runner.generate(prompts[:2], SamplingParams(max_new_tokens=NEW))
        assert runner.stats.graph_replays > 0
        one = runner.generate(prompts[1:2], SamplingParams(max_new_tokens=NEW))  # bucket 1 after bucket 2
        again = runner.generate(prompts[:2], SamplingParams(max_new_tokens=NEW))
    assert [r.tokens for r in got] == [r.tokens for r in again] == want and one[0].tokens == want[1]
    if isinstance(runner.graph.adapter, CompileGraphAdapter):
        # the model and hwkv's attention compile whole (no graph break), one frame per bucket, never recompiled
        assert dict(counters["frames"]) == {"total": 2, "ok": 2} and not counters["graph_break"]


class _RefusingAdapter:
    """A graph adapter whose capture fails, as a model whose code cannot be captured makes it fail."""

    def capture(self, fn):
        raise RuntimeError("boom: this step cannot be captured")


def test_failed_capture_falls_back_under_auto_and_raises_under_on(saved, prompts, monkeypatch):
    import hwkv.integrations.runner as runner_module

    monkeypatch.setattr(runner_module, "graph_adapter", lambda spec, choice: _RefusingAdapter())
    model = _load(saved["mistral"])
    want = hf_greedy(model, prompts[:2])
    with HybridRunner(model, max_running=2, context=48, graphs="auto") as runner:
        assert runner.graph is None
        assert runner.stats.graph_error == \
            "decode graph capture failed: RuntimeError: boom: this step cannot be captured"
        assert [r.tokens for r in runner.generate(prompts[:2], SamplingParams(max_new_tokens=NEW))] == want
    with pytest.raises(ConfigError, match="graphs='on': decode graph capture failed"):
        HybridRunner(model, max_running=2, context=48, graphs="on")
    assert model.config._attn_implementation == "eager"  # a runner that failed to start restored it too


def test_stop_tokens_and_max_new_tokens(saved, prompts):
    model = _load(saved["gpt_oss"])
    want = hf_greedy(model, prompts[2:], new=NEW)
    ref = want[0]
    i = next(k for k in range(3, NEW) if ref[k] not in ref[:k])  # the first occurrence of a later token
    with HybridRunner(model, max_running=2, chunk=16, context=48) as runner:
        got = runner.generate(prompts[2:], [SamplingParams(max_new_tokens=NEW, stop_token_ids=(ref[i],)),
                                            SamplingParams(max_new_tokens=5)])
    assert (got[0].tokens, got[0].finish_reason) == (ref[:i + 1], "stop")
    assert (got[1].tokens, got[1].finish_reason) == (want[1][:5], "length")


def test_sampling_is_reproducible_and_independent_of_the_batch(saved, prompts):
    model = _load(saved["gemma2"])
    params = [SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=s) for s in (7, 8, 9, 10)]

    def run(ps, prs):
        with HybridRunner(model, max_running=4, chunk=16, context=48) as runner:
            return [r.tokens for r in runner.generate(ps, prs)]

    first = run(prompts, params)
    assert run(prompts, params) == first
    assert run(prompts[1:2], params[1:2]) == first[1:2]  # alone, it draws what it drew beside the others
    other = run(prompts, [SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=s) for s in (1, 2, 3, 4)])
    assert other != first
    assert first != hf_greedy(model, prompts, new=16)


def test_sampler_follows_the_softmax_and_the_nucleus():
    n = 6000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(n, 1)
    ones, seeds, steps = torch.ones(n), torch.arange(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    freq = torch.bincount(sample(logits, ones, ones, seeds, steps, True), minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03), freq
    freq = torch.bincount(sample(logits, ones, ones * 0.7, seeds, steps, True), minlength=4).float() / n
    assert freq[2:].sum() == 0 and abs(float(freq[0]) - 0.625) < 0.03, freq  # nucleus {0, 1}, renormalised
    cold = sample(logits, ones * 0.05, ones, seeds, steps, True)
    assert (cold == 0).float().mean() > 0.99
    greedy = sample(logits, torch.zeros(n), ones, seeds, steps, True)
    assert (greedy == 0).all()


def test_request_too_long_for_the_cache_gets_a_typed_error(saved, prompts):
    model = _load(saved["gemma3"])
    long_prompt = list(range(40))
    want = hf_greedy(model, [prompts[0], prompts[1]])
    with HybridRunner(model, max_running=2, chunk=8, page_size=4, context=32) as runner:
        with pytest.raises(OutOfSlotsError, match=r"prompt 40 \+ max_new_tokens 12 needs 51 KV slots.*at most 32"):
            runner.add_request(long_prompt, SamplingParams(max_new_tokens=NEW))
        results = runner.generate([prompts[0], long_prompt, prompts[1]], SamplingParams(max_new_tokens=NEW))
        runner.check_integrity()
    assert isinstance(results[1].error, OutOfSlotsError) and results[1].tokens == []
    assert [results[0].tokens, results[2].tokens] == want


def test_requests_wait_for_room_in_a_small_budget(saved, prompts):
    """A budget that holds two requests' worst case: the others wait, nothing hangs, tokens stay exact."""
    model = _load(saved["gpt_oss"])
    want = hf_greedy(model, prompts)
    shape = model_shape(model.config, torch.float32)
    probe = plan_pools(shape, context=40, max_running=2, chunk=8, page_size=4, memory=None, device=torch.device("cpu"),
                       prefix_cache=True)  # the runner's default: room for each request's cache lock window
    with HybridRunner(model, memory=probe.memory_bytes, max_running=8, chunk=8, page_size=4, context=40) as runner:
        assert runner.cache.plan.max_running == 2
        got = run_staggered(runner, prompts, SamplingParams(max_new_tokens=NEW), add_at=(0, 0, 0, 0))
    assert [got[i] for i in range(4)] == want


def test_layer_kinds_and_shape_from_configs():
    cfgs = _configs()
    assert layer_kinds(cfgs["gpt_oss"]) == (True, False, True, False)
    assert layer_kinds(cfgs["cohere2"]) == (True, True, True, False)
    assert layer_kinds(cfgs["mistral"]) == (True,) * 4
    assert layer_kinds(cfgs["mistral_full"]) == (False,) * 4
    qwen = transformers.Qwen2Config(**COMMON, sliding_window=8, use_sliding_window=False)
    assert layer_kinds(qwen) == (False,) * 4
    shape = model_shape(cfgs["gemma3"], torch.bfloat16)
    assert (shape.swa_layer_ids, shape.full_layer_ids, shape.window, shape.num_kv_heads, shape.head_dim,
            shape.dtype_bytes) == ((0, 1, 3), (2,), 12, 2, 16, 2)
    bad = transformers.GptOssConfig(**COMMON, sliding_window=8, rope_parameters=ROPE)
    bad.layer_types = ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ConfigError, match="chunked_attention"):
        layer_kinds(bad)


def test_pools_are_planned_like_hwkv_plan():
    from hwkv.engine.plan import plan

    shape = model_shape(_configs()["gpt_oss"], torch.float32)
    got = plan_pools(shape, context=64, max_running=64, chunk=16, page_size=4, memory="1MiB",
                     device=torch.device("cpu"))
    want = plan(shape, 2**20, 64, page_size=4, chunk=16)
    assert (got.size, got.size_swa, got.max_running) == (want.full_pool_tokens, want.swa_pool_tokens, want.max_running)
    all_swa = plan_pools(model_shape(_configs()["mistral"], torch.float32), context=64, max_running=3, chunk=16,
                         page_size=4, memory=None, device=torch.device("cpu"))
    assert (all_swa.size, all_swa.size_swa, all_swa.full_bytes_per_token) == (3 * 64, 3 * 20 + 16, 0)
    with pytest.raises(ConfigError, match="at most 0 fit"):
        plan_pools(shape, context=64, max_running=1, chunk=16, page_size=4, memory="1KiB", device=torch.device("cpu"))


def test_attention_function_needs_the_runner(saved):
    model = _load(saved["cohere2"])
    runner = HybridRunner(model, max_running=1, context=16)
    ids = torch.tensor([[1, 2, 3]], device=DEVICE)
    with pytest.raises(ConfigError, match="without hwkv_forward"):
        model(input_ids=ids, use_cache=False)
    runner.close()
    assert model(input_ids=ids).logits.shape == (1, 3, 128)
    with pytest.raises(ConfigError, match="closed"):
        runner.step()


@pytest.mark.parametrize("first_closed", ["opened first", "opened last"])
def test_two_runners_on_one_model_keep_hwkv_attention_until_the_last_closes(first_closed, saved, prompts):
    """Two runners open on one model: closing either leaves the other decoding through hwkv (right tokens), and the
    model gets its own attention implementation back only when the last one closes (whichever order)."""
    model = _load(saved["gemma3"])
    p = SamplingParams(max_new_tokens=8)
    with HybridRunner(model, max_running=2, context=48) as ref:
        want = [r.tokens for r in ref.generate(prompts[:2], p)]
    assert model.config._attn_implementation == "eager"
    r1 = HybridRunner(model, max_running=2, context=48)
    r2 = HybridRunner(model, max_running=2, context=48)
    gone, left = (r1, r2) if first_closed == "opened first" else (r2, r1)
    gone.close()
    assert model.config._attn_implementation == "hwkv"
    assert [r.tokens for r in left.generate(prompts[:2], p)] == want
    left.check_integrity()
    left.close()
    assert model.config._attn_implementation == "eager"
    gone.close()  # closing twice changes nothing
    assert model.config._attn_implementation == "eager"


def test_a_forward_that_ran_no_hwkv_layer_is_a_config_error_and_changes_nothing(saved, prompts):
    """The model's attention switched away from hwkv while a runner is open (set_attn_implementation): its forward
    ran transformers' own attention over the packed row (wrong tokens, silently); now the step raises ConfigError
    naming the implementation before it allocates (graph replays too, which would run the attention they captured),
    and runs again once hwkv attention is back."""
    from test_engine_defects import _snapshot, _unchanged

    model = _load(saved["gemma2"])
    p = SamplingParams(max_new_tokens=8)
    with HybridRunner(model, max_running=2, context=48) as ref:
        want = [r.tokens for r in ref.generate(prompts[:2], p)]
    with HybridRunner(model, max_running=2, context=48) as runner:
        rids = [runner.add_request(q, p) for q in prompts[:2]]
        out = {}
        for _ in range(3):
            out.update((r.rid, r.tokens) for r in runner.step())
        model.set_attn_implementation("eager")
        before = _snapshot(runner)
        with pytest.raises(ConfigError, match=r"attention implementation is 'eager', not 'hwkv'"):
            runner.step()
        assert _unchanged(_snapshot(runner), before)
        runner.check_integrity()
        model.set_attn_implementation("hwkv")
        while runner.has_work():
            out.update((r.rid, r.tokens) for r in runner.step())
            runner.check_integrity()
        assert [out[r] for r in rids] == want
    assert model.config._attn_implementation == "eager"


def test_a_forward_where_one_layer_ran_another_attention_is_a_config_error(saved, prompts):
    """One layer switched away from hwkv (its own config copy says "eager"): the others still call hwkv, so a check
    for no call at all would pass; the runner counts the layers that ran hwkv against the model's. Eager forwards
    (graphs off): a replayed graph runs the hwkv attention it captured for every layer, so there the switch shows at
    the next forward that runs the model."""
    import copy

    from test_engine_defects import _snapshot, _unchanged

    model = _load(saved["gemma2"])
    with HybridRunner(model, max_running=2, context=48, graphs="off") as runner:
        runner.add_request(prompts[0], SamplingParams(max_new_tokens=4))
        runner.step()
        attn = model.model.layers[1].self_attn
        shared = attn.config
        attn.config = copy.copy(shared)
        attn.config._attn_implementation = "eager"
        before = _snapshot(runner)
        n = runner.shape.num_layers
        with pytest.raises(ConfigError, match=rf"but {n - 1} of its {n} attention layers ran hwkv attention"):
            runner.step()
        assert _unchanged(_snapshot(runner), before)
        attn.config = shared
        while runner.has_work():
            runner.step()
            runner.check_integrity()


def _cli(capsys, *argv: str):
    code = cli.main(["generate", *argv, "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generate_from_token_ids(saved, prompts, capsys):
    want = hf_greedy(_load(saved["gpt_oss"]), prompts[:2], new=6)
    args = ["--model", str(saved["gpt_oss"]), "--prompt", ",".join(map(str, prompts[0])),
            "--prompt", " ".join(map(str, prompts[1])), "--max-new-tokens", "6"]
    code, out, err = _cli(capsys, *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["schema"] == "hwkv-generate/1" and [r["tokens"] for r in data["results"]] == want
    assert data["stats"]["generated_tokens"] == 12 and data["stats"]["kv_memory"]["peak_held_bytes"] > 0
    code, out, err = _cli(capsys, *args)
    assert code == 0 and "tokens/s" in out and "KV memory held at peak" in out and "all-full" in out
    assert "reused from the prefix cache" in out


def test_cli_generate_reuses_a_shared_prefix_and_can_go_without(saved, prompts, capsys):
    """Two prompts sharing 16 tokens, one at a time (--max-running 1): the second takes them from the cache;
    --no-prefix-cache computes everything, with the same tokens."""
    system = prompts[3][:16]
    args = ["--model", str(saved["gpt_oss"]), "--max-new-tokens", "4", "--max-running", "1", "--page-size", "4",
            "--prompt", ",".join(map(str, system + prompts[0])), "--prompt", ",".join(map(str, system + prompts[1]))]
    runs = {}
    for extra in ((), ("--no-prefix-cache",)):
        code, out, err = _cli(capsys, *args, *extra, "--json")
        assert code == 0, err
        runs[extra] = json.loads(out)
    on, off = runs[()], runs[("--no-prefix-cache",)]
    assert on["prefix_cache"] and on["stats"]["reused_tokens"] == 16
    assert not off["prefix_cache"] and off["stats"]["reused_tokens"] == 0
    assert on["stats"]["prefill_tokens"] == off["stats"]["prefill_tokens"] - 16
    assert [r["tokens"] for r in on["results"]] == [r["tokens"] for r in off["results"]]


def test_cli_generate_with_a_tokenizer(saved, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "with-tokenizer"
    model = _load(saved["gemma2"])
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(folder)
    want = hf_greedy(model, [[5, 9, 17, 33]], new=5)[0]
    code, out, err = _cli(capsys, "--model", str(folder), "--prompt", "w5 w9 w17 w33", "--max-new-tokens", "5",
                          "--json")
    assert code == 0, err
    res = json.loads(out)["results"][0]
    assert res["prompt_ids"] == [5, 9, 17, 33] and res["tokens"] == want
    assert res["text"].split() == [f"w{t}" for t in want]


def test_cli_generate_errors(saved, tmp_path, capsys):
    path = str(saved["cohere2"])
    code, _, err = _cli(capsys, "--model", path, "--prompt", "1,two,3")
    assert code == 2 and "'two' is not a token id" in err
    code, _, err = _cli(capsys, "--model", str(tmp_path / "missing"), "--prompt", "1")
    assert code == 2 and ("cannot load model" in err or "no such folder" in err)
    code, out, err = _cli(capsys, "--model", path, "--prompt", "1,2", "--prompt", ",".join(["3"] * 30),
                          "--context", "16", "--max-new-tokens", "4")
    assert code == 2 and "OutOfSlotsError" in err and "[0] '1,2' -> " in out


def test_hwkv_imports_no_transformers():
    code = ("import sys, hwkv, hwkv.cli, hwkv.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# ---- MiMo-V2-Flash: V head dim unlike K's, SWA layers with their own KV head count -------------------------------
needs_mimo = pytest.mark.skipif("mimo_v2" not in ARCHS, reason="this transformers has no MiMo-V2-Flash model")


@needs_mimo
def test_mimo_v2_shape_reads_v_head_dim_and_the_swa_kv_heads():
    cfg = _configs()["mimo_v2"]
    shape = model_shape(cfg, torch.float32)
    assert shape.layer_is_swa == (False, True, True, True)  # transformers' default: layer 0 and every 6th full
    assert (shape.num_kv_heads, shape.head_dim, shape.v_head_dim) == (2, 24, 8)
    assert (shape.swa_num_kv_heads, shape.swa_head_dim, shape.swa_v_head_dim, shape.window) == (4, 24, 8, 9)
    cfg.swa_num_key_value_heads = 8  # the hub config names it; transformers' module still builds 2 x 2
    with pytest.raises(ConfigError, match="swa_num_key_value_heads=8.*= 4"):
        model_shape(cfg, torch.float32)
    cfg.swa_num_key_value_heads = 4
    assert model_shape(cfg, torch.float32) == shape


@needs_mimo
def test_mimo_v2_through_pages_of_one_and_graph_decode(saved, prompts):
    model = _load(saved["mimo_v2"])
    want = hf_greedy(model, prompts)
    with HybridRunner(model, max_running=4, chunk=5, page_size=1, context=48, graphs="eager") as runner:
        pool = runner.cache.pool
        assert (pool.swa_kv_pool.head_num, pool.full_kv_pool.head_num) == (4, 2)
        got = runner.generate(prompts, SamplingParams(max_new_tokens=NEW))
        runner.check_integrity()
        assert runner.stats.graph_replays > 0
    assert [r.tokens for r in got] == want


@needs_mimo
def test_a_layer_geometry_the_config_misses_is_a_config_error(saved, prompts, monkeypatch):
    """What MiMo-V2 hit before hwkv knew its SWA layers' KV heads: now a ConfigError naming the layer, at its
    first call, instead of a ShapeError from inside the pool."""
    monkeypatch.setattr(hf_model, "SWA_KV_HEADS_MULTIPLE", {})
    model = _load(saved["mimo_v2"])
    # at the model's first call: on accelerators that is the graph capture inside the runner's construction
    with pytest.raises(ConfigError, match=r"layer 1 \(sliding\).*\(4, 24, 8\).*\(2, 24, 8\)"):
        with HybridRunner(model, max_running=1, context=48) as runner:
            runner.generate(prompts[:1], SamplingParams(max_new_tokens=2))


# ---- seeds: one SamplingParams for many prompts, requests added without a seed -----------------------------------
def test_one_sampling_params_gives_each_prompt_its_own_seed(saved, prompts):
    model = _load(saved["gemma2"])
    same = [prompts[3]] * 3
    hot = dict(max_new_tokens=16, temperature=1.0)
    with HybridRunner(model, max_running=3, chunk=32, context=48) as runner:
        got = runner.generate(same, SamplingParams(**hot, seed=5))
        assert [r.seed for r in got] == [5, 6, 7]
        assert len({tuple(r.tokens) for r in got}) == 3, "equal prompts drew the same stream"
        pinned = runner.generate(same, [SamplingParams(**hot, seed=s) for s in (5, 6, 7)])
        assert [r.tokens for r in pinned] == [r.tokens for r in got]  # seed + i, as `hwkv generate --seed` does
        assert [r.seed for r in runner.generate(same[:2], SamplingParams(**hot))] == [0, 1]  # no seed: the index
        rids = [runner.add_request(prompts[3], SamplingParams(**hot)) for _ in range(2)]
        added = {}
        while runner.has_work():
            added.update({r.rid: r for r in runner.step()})
    assert [added[r].seed for r in rids] == rids  # no seed: the request id
    assert added[rids[0]].tokens != added[rids[1]].tokens
    with pytest.raises(ConfigError, match="seed must be None or an integer"):
        SamplingParams(seed=-1)
    assert SamplingParams(seed=2**32 - 1).with_seed(2).seed == 1  # wraps into [0, 2**32)


# ---- default pool memory: a share of what the device has free ----------------------------------------------------
GiB = 2**30


def test_available_ram_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    assert pools.available_ram_bytes(str(meminfo)) == 20000000 * 1024
    assert pools.available_ram_bytes(str(tmp_path / "missing")) > 0  # sysconf's free pages instead
    assert 0 < pools.free_device_bytes(torch.device("cpu"))


def test_default_memory_is_a_modest_share_of_free_memory(monkeypatch):
    cpu = torch.device("cpu")
    shape = model_shape(_configs()["gpt_oss"], torch.float32)
    monkeypatch.setattr(pools, "available_ram_bytes", lambda: 24 * GiB)
    assert pools.default_memory_cap(cpu) == 4 * GiB  # a quarter is 6 GiB: capped
    big = plan_pools(shape, context=4096, max_running=100_000, chunk=512, page_size=16, memory=None, device=cpu)
    assert big.memory_bytes == 4 * GiB and big.pool_bytes <= 4 * GiB and big.max_running < 100_000
    small = plan_pools(shape, context=64, max_running=4, chunk=16, page_size=4, memory=None, device=cpu)
    assert small.memory_bytes == pools.kv_bytes_needed(shape, 64, 4, 4, 16)  # what the requests need
    monkeypatch.setattr(pools, "available_ram_bytes", lambda: 8 * GiB)
    assert pools.default_memory_cap(cpu) == 2 * GiB
    with pytest.raises(ConfigError, match="more than the 8.00 GiB cpu has free"):
        plan_pools(shape, context=64, max_running=4, chunk=16, page_size=4, memory="20GiB", device=cpu)
    # accelerators: torch.<type>.mem_get_info, the device-neutral path (no GPU needed to test it)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 80 * GiB))
    assert pools.free_device_bytes(torch.device("cuda")) == 10 * GiB
    assert pools.default_memory_cap(torch.device("cuda")) == 8 * GiB
    with pytest.raises(ConfigError, match="no mem_get_info"):
        pools.free_device_bytes(torch.device("meta"))


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3"])
def test_overlap_reads_tokens_a_step_late_and_changes_no_token(arch, saved, prompts):
    """overlap=True (the accelerators' default) on the CPU: the sampled tokens feed the next forward from the
    device and the host reads them one step late. Greedy tokens equal transformers', stops and lengths finish as
    without overlap, the token a stopped request sampled after its stop is dropped (and not counted), and every
    step leaves the cache consistent (slots of finished requests freed after their extra forward)."""
    model = _load(saved[arch])
    want = hf_greedy(model, prompts)
    with HybridRunner(model, max_running=3, chunk=8, page_size=4, context=48, overlap=True) as runner:
        got = run_staggered(runner, prompts, SamplingParams(max_new_tokens=NEW))
        runner.clear_prefix_cache()
        assert runner.cache.held_slots() == (0, 0) and not runner.has_work()
        assert runner.stats.generated_tokens == NEW * len(prompts) and runner.stats.peak_held_bytes > 0
    assert [got[i] for i in range(len(prompts))] == want
    ref = want[2]
    i = next(k for k in range(3, NEW) if ref[k] not in ref[:k])
    params = [SamplingParams(max_new_tokens=NEW, stop_token_ids=(ref[i],)), SamplingParams(max_new_tokens=5),
              SamplingParams(max_new_tokens=9, temperature=0.8, seed=3)]
    results = {}
    for overlap in (False, True):
        with HybridRunner(model, max_running=2, chunk=16, context=48, overlap=overlap) as runner:
            results[overlap] = [(r.tokens, r.finish_reason) for r in runner.generate(prompts[2:] + prompts[:1], params)]
            runner.check_integrity()
            assert runner.stats.generated_tokens == sum(len(t) for t, _ in results[overlap])
            assert runner.stats.dropped_tokens == (1 if overlap else 0)  # the stopped request's one extra token
    assert results[True] == results[False]
    assert results[True][0] == (ref[:i + 1], "stop") and results[True][1] == (want[3][:5], "length")


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3"])
def test_a_conversation_reuses_its_history_from_the_prefix_cache(arch, saved):
    """Four turns, each prompt = the previous prompt + its reply + new user tokens, through one runner: every
    turn's greedy tokens equal transformers' generate() on the same prompt, with the prefix cache and without;
    with it, each later turn computes only what the cache did not hold (prefill = prompt - reused, exactly)
    and reuses most of its history."""
    model = _load(saved[arch])
    g = torch.Generator().manual_seed(5)
    user = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (8, 4, 4, 4)]
    reply = 6
    outputs = {}
    for cached in (True, False):
        with HybridRunner(model, max_running=2, chunk=8, page_size=4, context=48, prefix_cache=cached) as runner:
            assert (runner.prefix is not None) == cached
            prompt, turns = [], []
            for t in range(4):
                prompt = prompt + user[t]
                before = (runner.stats.prompt_tokens, runner.stats.reused_tokens, runner.stats.prefill_tokens)
                (res,) = runner.generate([prompt], SamplingParams(max_new_tokens=reply))
                runner.check_integrity()
                p_tok, reused, computed = (a - b for a, b in zip(
                    (runner.stats.prompt_tokens, runner.stats.reused_tokens, runner.stats.prefill_tokens), before))
                assert p_tok == len(prompt) and computed == p_tok - reused
                if cached and t:  # the history up to the last whole page before the reply's last token
                    assert reused >= (len(prompt) - len(user[t]) - 1) // 4 * 4 - 4, (t, reused, len(prompt))
                elif not cached:
                    assert reused == 0
                turns.append(res.tokens)
                prompt = prompt + res.tokens
            outputs[cached] = turns
            if cached:
                assert runner.stats.reused_tokens > 0.5 * runner.stats.prompt_tokens - len(user[0])
                assert "reused from the prefix cache" in runner.stats.prefix_line()
    assert outputs[True] == outputs[False]
    prompt = []
    for t in range(4):  # transformers' own generate() on each turn's prompt
        prompt = prompt + user[t]
        assert hf_greedy(model, [prompt], new=reply)[0] == outputs[True][t]
        prompt = prompt + outputs[True][t]


def test_a_shared_system_prompt_is_computed_once(saved, prompts):
    """Requests sharing a system prompt, one at a time: the later ones take it from the cache."""
    model = _load(saved["gpt_oss"])
    system = prompts[3][:16]
    asks = [system + p[:5] for p in prompts[:3]]
    want = hf_greedy(model, asks, new=5)
    with HybridRunner(model, max_running=1, chunk=16, page_size=4, context=48) as runner:
        got = runner.generate(asks, SamplingParams(max_new_tokens=5))
        runner.check_integrity()
        assert runner.stats.reused_tokens == 2 * 16  # the second and third take the 16 shared tokens
        assert runner.stats.prefill_tokens == runner.stats.prompt_tokens - 32
    assert [r.tokens for r in got] == want


def test_the_prefix_cache_under_memory_pressure_evicts_and_stays_exact(saved, prompts):
    """A budget for two requests' worst case, eight requests with shared prefixes of different lengths added as
    the run goes: the cache fills the pools, admissions and forwards evict from it, every step leaves pools,
    allocator, rows and cache consistent, and the tokens equal those of a run without the cache."""
    model = _load(saved["gemma3"])
    shape = model_shape(model.config, torch.float32)
    g = torch.Generator().manual_seed(9)
    base = torch.randint(0, 128, (24,), generator=g).tolist()
    asks = [base[:k] + torch.randint(0, 128, (n,), generator=g).tolist()
            for k, n in ((20, 6), (12, 9), (20, 3), (4, 13), (16, 8), (24, 2), (8, 11), (20, 5))]
    results = {}
    for cached in (True, False):
        probe = plan_pools(shape, context=40, max_running=2, chunk=8, page_size=4, memory=None,
                           device=torch.device("cpu"), prefix_cache=cached)
        with HybridRunner(model, memory=probe.memory_bytes, max_running=4, chunk=8, page_size=4, context=40,
                          prefix_cache=cached) as runner:
            evicted = []
            if cached:
                for name in ("evict", "evict_swa"):
                    inner = getattr(runner.prefix, name)
                    setattr(runner.prefix, name, lambda n, inner=inner: evicted.append(inner(n)) or evicted[-1])
            got = run_staggered(runner, asks, SamplingParams(max_new_tokens=8), add_at=(0, 0, 1, 2, 3, 5, 8, 13))
            results[cached] = [got[i] for i in range(len(asks))]
            if cached:
                assert runner.stats.reused_tokens > 0 and sum(evicted) > 0
    assert results[True] == results[False]


def test_cli_generate_runs_a_conversation_from_the_prefix_cache(saved, prompts, capsys):
    """`hwkv generate --conversation`: four user turns, each sent with the conversation so far; the replies equal
    transformers' generate() on each turn's whole prompt, and the cache spares recomputing the history
    (prefill computed = prompt tokens - reused, against every prompt token without the cache)."""
    turns = [prompts[1][:6], prompts[0][:3], prompts[2][:4], prompts[3][:3]]
    args = ["--model", str(saved["gpt_oss"]), "--max-new-tokens", "5", "--page-size", "4", "--conversation",
            *[a for t in turns for a in ("--prompt", ",".join(map(str, t)))], "--json"]
    runs = {}
    for extra in ((), ("--no-prefix-cache",)):
        code, out, err = _cli(capsys, *args, *extra)
        assert code == 0, err
        runs[extra] = json.loads(out)
    on, off = runs[()], runs[("--no-prefix-cache",)]
    sent = [r["prompt_ids"] for r in on["results"]]
    assert all(sent[i + 1][:len(sent[i]) + 5] == sent[i] + on["results"][i]["tokens"] for i in range(3))
    assert [r["tokens"] for r in on["results"]] == [r["tokens"] for r in off["results"]]
    assert [r["tokens"] for r in on["results"]] == [hf_greedy(_load(saved["gpt_oss"]), [s], new=5)[0] for s in sent]
    s_on, s_off = on["stats"], off["stats"]
    assert s_on["prompt_tokens"] == s_off["prompt_tokens"] == sum(map(len, sent))
    assert s_on["prefill_tokens"] == s_on["prompt_tokens"] - s_on["reused_tokens"]
    assert s_on["reused_tokens"] >= 0.5 * sum(map(len, sent[1:])) and s_off["reused_tokens"] == 0


def test_cli_generate_with_prompt_lookup_drafts(saved, prompts, capsys):
    """`hwkv generate --draft prompt-lookup`: a prompt that repeats itself gets drafts from its own earlier
    tokens; the tokens equal the run without drafts, and the draft line is printed; --num-draft 0 is refused."""
    prompt = ",".join(map(str, prompts[3] * 2))  # its greedy reply repeats (64, 2, 64, 2, ...): drafts that hit
    base = ["--model", str(saved["gemma2"]), "--max-new-tokens", "8", "--prompt", prompt]
    runs = {}
    for extra in ((), ("--draft", "prompt-lookup", "--num-draft", "3")):
        code, out, err = _cli(capsys, *base, *extra, "--json")
        assert code == 0, err
        runs[extra] = json.loads(out)
    spec = runs[("--draft", "prompt-lookup", "--num-draft", "3")]
    assert spec["results"][0]["tokens"] == runs[()]["results"][0]["tokens"]
    assert spec["stats"]["accepted_tokens"] > 0 and "accepted" in spec["draft"] and runs[()]["draft"] is None
    code, out, err = _cli(capsys, *base, "--draft", "prompt-lookup")
    assert code == 0 and "speculative verify:" in out
    code, out, err = _cli(capsys, *base, "--num-draft", "0")
    assert code == 2 and "--num-draft must be >= 1, got 0" in err and "Traceback" not in err


def test_a_waiting_request_does_not_read_the_device_every_step(saved, prompts):
    """With the prefix cache, admission reads the allocator's free slots (a device read on accelerators). A
    request refused for room is retried only after a request left or the cache grew, not at every step; then
    it runs as usual."""
    model = _load(saved["gpt_oss"])
    want = hf_greedy(model, prompts[:2])
    with HybridRunner(model, max_running=2, chunk=32, page_size=4, context=40) as runner:
        first = runner.add_request(prompts[0], SamplingParams(max_new_tokens=NEW))
        got = {r.rid: r.tokens for r in runner.step()}  # the first runs (its prompt cached)
        reads, full = [], [0]  # the pools look full until full[0] is set back
        inner = runner.cache.allocator.full_available_size
        runner.cache.allocator.full_available_size = lambda: reads.append(1) or (full[0] if full[0] >= 0 else inner())
        second = runner.add_request(prompts[1], SamplingParams(max_new_tokens=NEW))
        for _ in range(5):
            assert runner.scheduler.admit(runner._prefixing.start) == []
        assert len(reads) == 1  # refused once, then the refusal stands: nothing changed
        runner._prefixing.left += 1   # as if a request left: worth asking again
        assert runner.scheduler.admit(runner._prefixing.start) == [] and len(reads) == 2
        full[0] = -1            # room again
        runner._prefixing.left += 1
        while runner.has_work():
            got.update({r.rid: r.tokens for r in runner.step()})
            runner.check_integrity()
    assert [got[first], got[second]] == want
