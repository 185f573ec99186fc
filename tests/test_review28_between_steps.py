"""Review 28: what a user changes between steps while a HybridRunner is open, and whether hwkv notices.

Each test is one defect: the runner goes on with silently different tokens (or a raw torch exception) where a
fresh runner on the model as it is now, or transformers' own greedy generate(), gives other tokens. Tiny random
models built from configs (as tests/test_transformers_integration.py builds them), CPU, fp32 unless said.
"""
from __future__ import annotations

import threading
from typing import List

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="hwkv's test extra")

from hwkv.errors import ConfigError, HwkvError  # noqa: E402
from hwkv.integrations.transformers import HybridRunner, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
              tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_gen = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(0, 128, (n,), generator=_gen).tolist() for n in (3, 11, 20, 29)]
KW = dict(max_running=4, context=64, page_size=4)


def _model(arch: str, seed: int = 2, dtype: torch.dtype = torch.float32):
    cfg = {"gpt_oss": lambda: transformers.GptOssConfig(**COMMON, sliding_window=8, num_local_experts=4,
                                                        num_experts_per_tok=2, rope_parameters=ROPE),
           "gemma2": lambda: transformers.Gemma2Config(**COMMON, sliding_window=8, query_pre_attn_scalar=32,
                                                       attn_logit_softcapping=5.0)}[arch]()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager").eval()


def _hf_greedy(model, prompts: List[List[int]], new: int) -> List[List[int]]:
    out = []
    for p in prompts:
        seq = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                             max_new_tokens=new, do_sample=False, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


def _drain(runner, rids) -> List[List[int]]:
    out = {}
    while runner.has_work():
        out.update((r.rid, r.tokens) for r in runner.step())
    runner.check_integrity()
    return [out[r] for r in rids]


# ---- 1. weights replaced (not copied) under an open runner: GPT-OSS's sinks stay the old ones ----------------------
@pytest.mark.parametrize("graphs", ["off", "eager"])
def test_weights_replaced_under_an_open_runner_act_as_weights_copied_in_place(graphs):
    """A weight update between steps (an RL loop's weight sync) by `load_state_dict(sd, assign=True)` or
    `param.data = new` must give the same tokens as `load_state_dict(sd)` (an in-place copy): afterwards the model
    holds the same weights over the same cached K/V. The runner's LayerTable keeps each layer's `sinks.detach()` from
    its first call (hf_attention.py LayerTable._make) and never compares later calls' sinks, so after a replacement
    every layer attends with the old sinks while the rest of the model runs the new weights."""
    new = {k: v.clone() for k, v in _model("gpt_oss", seed=5).state_dict().items()}

    def inplace(m):
        m.load_state_dict(new)

    def assign(m):
        m.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)

    def data(m):
        for name, prm in m.named_parameters():
            prm.data = new[name].clone()

    got = {}
    for update in (inplace, assign, data):
        m = _model("gpt_oss")
        with HybridRunner(m, graphs=graphs, **KW) as r:
            rids = [r.add_request(q, SamplingParams(max_new_tokens=8)) for q in PROMPTS]
            r.step()
            r.step()
            update(m)
            got[update.__name__] = _drain(r, rids)
    assert got["assign"] == got["inplace"], "load_state_dict(assign=True): the layers kept the old sinks"
    assert got["data"] == got["inplace"], "param.data = ...: the layers kept the old sinks"


# ---- 2. the model's dtype changed under an open runner --------------------------------------------------------------
def _spy(runner) -> List[torch.Tensor]:
    """The logits of every forward the runner runs from now on (fp32 copies): every path, the graphs' functions too,
    calls the model through `model_step`."""
    seen, run = [], runner.model_step

    def spy(*args):
        out = run(*args)
        seen.append(out.detach().float().clone())
        return out

    runner.model_step = spy
    return seen


def _decode_logits(runner, steps: int = 3) -> torch.Tensor:
    """The logits of the runner's `steps`-th step (a decode step for PROMPTS at the default chunk), fp32 on the host."""
    for q in PROMPTS:
        runner.add_request(q, SamplingParams(max_new_tokens=8))
    seen = _spy(runner)
    for _ in range(steps):
        runner.step()
    return seen[-1]


@pytest.mark.parametrize("graphs", ["off", "eager"])
def test_a_model_moved_to_another_dtype_under_an_open_runner_is_refused_or_served_as_a_fresh_runner_would(graphs):
    """The pools are built in the model's dtype at construction (bf16 here); `model.float()` while the runner is open
    is not noticed (`_check_model` reads only the attention implementation): the fp32 model's K/V are rounded into
    the bf16 pools, so a decode step's logits are off by ~0.06 from a fresh runner's on the fp32 model (fp32 agrees
    within 1e-4), and greedy tokens differ after a few steps (for the model built in fp32 and cast to bf16, then
    back: [43, 10, 120, 122, 88, ...] for PROMPTS[1] where transformers' generate gives [43, 10, 120, 5, 7, ...]).
    Expected: a typed error naming the dtypes, or the fresh runner's logits."""
    m = _model("gpt_oss", dtype=torch.bfloat16)
    with HybridRunner(m, graphs=graphs, **KW) as r:
        m.float()
        try:
            got = _decode_logits(r)
        except HwkvError as e:  # refused: fine, if it says why
            assert "dtype" in str(e) or "float32" in str(e) or "bfloat16" in str(e), str(e)
            return
    with HybridRunner(m, graphs=graphs, **KW) as r:
        want = _decode_logits(r)
    assert (got - want).abs().max().item() < 1e-4, "the runner kept bf16 pools under an fp32 model, silently"


# ---- 3. a step (or generate) inside a step: from a callback, or from a second thread -------------------------------
@pytest.mark.parametrize("inner", ["step", "generate", "step-from-a-second-thread"])
def test_a_step_inside_a_running_step_is_refused_as_abort_is(inner):
    """`abort` inside a step is a ConfigError (a step was running), but `step()` and `generate()` do not look at it: called
    from inside a step (a drafter here; a second thread serving the same runner is the same case) the nested step
    runs the same scheduled rows again. Measured: the nested step leaves the outer generate with wrong tokens
    ([19, 93, 34, 82, 91, 86, 107, 126] where greedy decoding gives [19, 93, 34, 82, 91, 45, 23, 100]); a nested
    generate corrupts the allocator (a raw LocError from the outer step's free). Expected: the inner call is refused
    with a ConfigError and the outer run's tokens are greedy decoding's."""
    m = _model("gemma2")
    p = SamplingParams(max_new_tokens=8)
    want = _hf_greedy(m, PROMPTS[:2], 8)
    box, refused = {}, []
    started, release = threading.Event(), threading.Event()

    def draft(history, k):
        if not started.is_set():
            started.set()
            if inner == "step-from-a-second-thread":
                release.wait(10)  # the main thread calls step() meanwhile
            else:
                try:
                    box["r"].step() if inner == "step" else box["r"].generate([[4, 5, 6]], p)
                except ConfigError as e:
                    refused.append(e)
        return [1, 2]

    with HybridRunner(m, graphs="off", draft=draft, num_draft=2, **KW) as r:
        box["r"] = r
        if inner == "step-from-a-second-thread":
            results, errors = [], []

            def serve():
                try:
                    results.extend(r.generate(PROMPTS[:2], p))
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            t = threading.Thread(target=serve)
            t.start()
            assert started.wait(10)
            try:
                r.step()
            except ConfigError as e:
                refused.append(e)
            finally:
                release.set()
                t.join(30)
            assert not errors, f"the serving thread raised {errors[0]!r}"
        else:
            results = r.generate(PROMPTS[:2], p)
        assert refused, f"{inner} inside a running step was not refused"
        assert [x.tokens for x in results] == want
        r.check_integrity()


# ---- 4. torch's default dtype changed between steps: the CPU decode kernel's softmax state follows it --------------
@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16])
def test_the_default_dtype_changed_between_steps_leaves_fp32_graph_decode_exact(default):
    """hwkv_cpu/kernels_decode.py `_merge` allocates its softmax state (m, l, acc) with `torch.full`/`torch.zeros`
    and no dtype, i.e. in torch's default dtype. Graph decode on the CPU (graphs="eager": the chunked kernels) then
    runs an fp32 model's attention with a bf16 accumulator after `torch.set_default_dtype(torch.bfloat16)` (logits
    off by 0.026 here, 0.096 for the tiny GPT-OSS, against 0.0 with graphs off: fp32 must agree within 1e-4), and
    after float16 a decode step raises a raw RuntimeError ("value cannot be converted to type c10::Half without
    overflow": NEG_BIG). Expected: the decode step's logits do not depend on the default dtype."""
    def decode_logits(dtype):
        m = _model("gemma2")
        with HybridRunner(m, graphs="eager", chunk=64, **KW) as r:
            for q in PROMPTS:
                r.add_request(q, SamplingParams(max_new_tokens=8))
            r.step()
            r.step()
            seen = _spy(r)
            before = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                r.step()
            finally:
                torch.set_default_dtype(before)
            return seen[-1]

    want = decode_logits(torch.float32)
    got = decode_logits(default)
    assert (got - want).abs().max().item() < 1e-4


# ---- 5. a weight update between generate calls: the prefix cache serves K/V of the old weights ---------------------
def test_a_weight_update_then_clear_prefix_cache_serves_the_new_weights():
    """The prefix cache keeps K/V the old weights computed; after `load_state_dict` (in place) a prompt extending a
    cached one reused it (28 of 32 prompt tokens here) and got other tokens than the updated model's own greedy
    generate, and nothing said to clear it. Detecting a weight update would read every parameter each step, so the
    README and `clear_prefix_cache` say what to do: clear it, and the updated model's tokens come back."""
    p = SamplingParams(max_new_tokens=8)
    new = _model("gemma2", seed=5).state_dict()
    m = _model("gemma2")
    longer = PROMPTS[3] + [1, 2, 3]
    with HybridRunner(m, chunk=8, **KW) as r:
        r.generate([PROMPTS[3]], p)
        m.load_state_dict(new)
        assert r.clear_prefix_cache() > 0
        got = r.generate([longer], p)[0].tokens
        assert r.stats.reused_tokens == 0   # the longer prompt computed again
    assert got == _hf_greedy(m, [longer], 8)[0]
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "after a weight update" in readme and "clear_prefix_cache()" in readme


# ---- 6. the vocabulary shrunk under an open runner: ids past it reach the embedding --------------------------------
def test_a_vocabulary_shrunk_under_an_open_runner_refuses_ids_past_it_with_a_typed_error():
    """`vocab_size` is read once at construction; after `model.resize_token_embeddings(100)` add_request still takes
    token 120 and every following step raises torch's raw `IndexError: index out of range in self` from the
    embedding (the step is undone, so the runner is stuck on that request until it is aborted). A grown vocabulary
    is a typed ShapeError at the step; a shrunk one should be a typed error too (at add_request, naming the id, or
    at the step, naming the vocabulary)."""
    m = _model("gemma2")
    with HybridRunner(m, **KW) as r:
        r.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
        r.step()
        m.resize_token_embeddings(100, mean_resizing=False)
        with pytest.raises(HwkvError):
            r.add_request([120, 3, 4], SamplingParams(max_new_tokens=4))
            r.step()
        r.check_integrity()
