"""Review 34: the Hugging Face transformers integration (`hwkv.integrations.runner`, `hf_attention`) driven with
transformers models whose attention does not fit the "one hwkv attention call per layer per forward" shape the
runner assumes.

Every test here fails on the code this review read; each docstring names the defect, what is expected and what
happens. Tiny random models built from configs (nothing is downloaded), fp32 on the CPU.
"""
from __future__ import annotations

import logging
from typing import List

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")

from hwkv.errors import ConfigError  # noqa: E402
from hwkv.integrations import runner as runner_module  # noqa: E402
from hwkv.integrations.transformers import HybridRunner, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
            tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)


def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()


def _hf_greedy(model, prompt: List[int], new: int) -> List[int]:
    """transformers' own generate(), greedy, one prompt (an explicit all-ones mask: no padding)."""
    gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                         max_new_tokens=new, do_sample=False, pad_token_id=0)
    return gen[0, len(prompt):].tolist()


def _prompts() -> List[List[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 120, (n,), generator=g).tolist() for n in (3, 11, 20)]


def _diffllama():
    cfg = transformers.DiffLlamaConfig(**TINY)
    torch.manual_seed(2)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


def _hrm_text():
    # one decoder layer per stack, looped H_cycles x (L_cycles + 1) = 4 times per forward: config.num_hidden_layers 4
    cfg = transformers.AutoConfig.for_model("hrm_text", **{**TINY, "num_hidden_layers": 4}, num_layers_per_stack=1,
                                            H_cycles=2, L_cycles=1, L_bp_cycles=[1])
    torch.manual_seed(2)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


def _has(name: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return name in CONFIG_MAPPING_NAMES


# ---- defect 1: a layer that calls the attention function more than once per forward ----------------------------------

@pytest.mark.parametrize("build,model_type", [(_diffllama, "diffllama"), (_hrm_text, "hrm_text")],
                         ids=["diffllama", "hrm_text"])
def test_a_model_calling_attention_twice_per_layer_is_served_exactly_or_refused(build, model_type):
    """Defect: `ForwardContext.attend` stores each call's K/V in the pools of `module.layer_idx`, and the runner only
    refuses a forward with *fewer* hwkv calls than layers (`ctx.calls < num_layers`). A model whose attention module
    calls the attention function twice in one forward (transformers' DiffLlama: once with each half of V, same
    layer_idx) or whose one module runs several times per forward (HRM-Text: one layer stack looped over cycles, the
    module's layer_idx fixed) overwrites that layer's K/V with the second call's: the prefill's first token is right,
    every later token attends to the wrong values, and generate() returns transformers-divergent tokens silently
    (greedy, same weights; measured: DiffLlama's first token equal, the next five differ).

    Expected (the runner's own promise: never tokens from another attention): either transformers' greedy tokens,
    or a typed ConfigError naming the layer attended twice in one forward (ForwardContext could keep the layer ids
    it served this forward and refuse a repeat; `calls != num_layers` is not enough: one layer twice and one never
    balance out)."""
    if not _has(model_type):
        pytest.skip(f"this transformers has no {model_type} model")
    _quiet_transformers()
    model = build()
    prompts = _prompts()
    want = [_hf_greedy(model, p, 6) for p in prompts]
    with HybridRunner(model, max_running=2, chunk=8, page_size=4, context=40) as runner:
        try:
            results = runner.generate(prompts, SamplingParams(max_new_tokens=6))
        except ConfigError as e:  # a typed refusal is a right answer too
            assert "layer" in str(e)
            return
    got = [r.tokens for r in results]
    assert [r.error for r in results] == [None] * len(prompts)
    assert got == want, f"{model_type}: hwkv returned {got}, transformers' greedy generate() {want}"


# ---- defect 2: a model whose attention implementation cannot be switched ----------------------------------------------

def _gpt_neo():
    cfg = transformers.GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                    attention_types=[[["global", "local"], 1]], window_size=4,
                                    max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _bloom():
    cfg = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, eos_token_id=None,
                                   bos_token_id=None)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.parametrize("build", [_gpt_neo, _bloom], ids=["gpt_neo", "bloom"])
def test_a_model_that_cannot_take_hwkv_attention_is_refused_when_the_runner_opens(build):
    """Defect: `HybridRunner.__init__` calls `model.set_attn_implementation("hwkv")` and never checks that it took.
    transformers only *logs* "GPTNeoForCausalLM does not support setting its attention implementation dynamically"
    for models that do not use its AttentionInterface (GPT-Neo, Bloom, MPT, XGLM, GPT-NeoX-Japanese, RWKV...), and
    leaves them on "eager". The runner opens, plans and allocates its pools, and only the first step fails, with
    `_check_model`'s message for a different situation: "(set_attn_implementation was called while this runner is
    open?): model.set_attn_implementation('hwkv') before the next step" -- advice the user cannot follow (the
    call is a no-op for these models; `hwkv generate` prints the same line to a user who called nothing).

    Expected: the constructor refuses with a ConfigError naming the model class and saying that its attention does
    not go through transformers' attention interface, the model keeps its own implementation and no runner stays
    registered as open on it (the constructor already closes itself on a refusal)."""
    _quiet_transformers()
    model = build()
    before = model.config._attn_implementation
    name = type(model).__name__
    runner = None
    try:
        with pytest.raises(ConfigError, match=name):
            runner = HybridRunner(model, max_running=1, context=32, page_size=4)
    finally:
        if runner is not None:  # (the current code: it opened; what its first step says, for the failure report)
            try:
                runner.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
            except ConfigError as e:
                logging.getLogger(__name__).warning("first step: %s", e)
            runner.close()
    assert model.config._attn_implementation == before
    assert model not in runner_module._OPEN


# ---- defect 3: a model that drops the runner's keyword arguments on the way to its attention ---------------------------

def test_a_model_dropping_hwkv_forward_gets_an_error_that_fits_what_happened():
    """Defect (the message): StableLM's decoder layer calls `self.self_attn(...)` without the `**kwargs` the runner's
    `hwkv_forward=` travels in (transformers' Nemotron too), so inside `HybridRunner.generate` the attention function
    raises "attention implementation 'hwkv' was called without hwkv_forward=: run the model through
    hwkv.integrations.transformers.HybridRunner, or switch it back with model.set_attn_implementation('sdpa')" -- to
    a caller who is running it through HybridRunner (the `hwkv generate` CLI prints the same line). The refusal is
    typed and changes nothing (checked below); what it tells the user is wrong.

    Expected: inside a runner's forward the refusal says that the model (its class named) does not pass the forward's
    keyword arguments on to its attention layers, so hwkv cannot serve it -- not to use the runner it is using
    (e.g. hwkv_attention can tell the two apart by whether a runner's forward is in progress, or the runner can
    re-raise with its own message)."""
    _quiet_transformers()
    cfg = transformers.StableLmConfig(**TINY)
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with HybridRunner(model, max_running=1, context=32, page_size=4) as runner:
        with pytest.raises(ConfigError) as info:
            runner.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        runner.check_integrity()  # held: the refusal changed nothing
        assert runner.cache.held_slots() == (0, 0)
    msg = str(info.value)
    assert "run the model through hwkv.integrations.transformers.HybridRunner" not in msg, msg
    assert type(model).__name__ in msg, msg
