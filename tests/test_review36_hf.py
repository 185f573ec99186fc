"""Review 36: the Hugging Face transformers integration (`hwkv.integrations.runner`, `hf_attention`) against
transformers' own forward / generate() on tiny random models (nothing is downloaded), fp32 on the CPU.

Every test fails on the code this review read; each docstring names the defect. The expected behaviour is
transformers' tokens (the runner's promise) or, where hwkv cannot serve the model, a typed ConfigError from
`hwkv.errors` with the model's attention implementation left as it was.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")

from hwkv.errors import ConfigError  # noqa: E402
from hwkv.integrations.transformers import HybridRunner, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
            tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)


def _prompts(lens, seed: int = 1) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]


def _build(cfg, seed: int = 2):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_greedy(model, prompt: List[int], new: int) -> List[int]:
    """transformers' own generate(), greedy, one prompt (an explicit all-ones mask: no padding)."""
    gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                         max_new_tokens=new, do_sample=False, pad_token_id=0)
    return gen[0, len(prompt):].tolist()


def _runner_or_refusal(model, **kw):
    """A runner over `model`, or None where it refused the model with a ConfigError (the model's own attention
    implementation back)."""
    before = model.config._attn_implementation
    try:
        return HybridRunner(model, max_running=4, chunk=64, page_size=4, context=64, **kw)
    except ConfigError:
        assert model.config._attn_implementation == before
        return None


# ---- a model whose forward ignores position_ids ------------------------------------------------------------------

def test_a_causal_lm_that_ignores_position_ids_is_served_exactly_or_refused():
    """Defect: BartForCausalLM (also MBart, Marian, Pegasus, Blenderbot, PLBart, MVP) has no position_ids argument:
    its decoder numbers the packed row 0..T-1 itself, so every decode step runs at position 0 (wrong tokens, no
    error; `hwkv generate` on a BART folder does the same). Expected: transformers' tokens or a ConfigError."""
    cfg = transformers.BartConfig(vocab_size=128, d_model=32, decoder_layers=2, encoder_layers=2, decoder_ffn_dim=64,
                                  encoder_ffn_dim=64, decoder_attention_heads=2, encoder_attention_heads=2,
                                  max_position_embeddings=64, init_std=0.3, eos_token_id=None, pad_token_id=None,
                                  bos_token_id=None, forced_eos_token_id=None, tie_word_embeddings=False)
    model = _build(cfg)
    assert type(model).__name__ == "BartForCausalLM"
    prompt = _prompts((11,))[0]
    want = _hf_greedy(model, prompt, 6)
    runner = _runner_or_refusal(model)
    if runner is None:
        return
    with runner:
        got = runner.generate([prompt], SamplingParams(max_new_tokens=6))[0]
    assert got.error is None and got.tokens == want


# ---- a RoPE whose frequencies follow the forward's largest position ------------------------------------------------

def _longrope_phi3():
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0 + i for i in range(8)], "original_max_position_embeddings": 16}
    return _build(transformers.Phi3Config(**TINY, rope_parameters=rope, original_max_position_embeddings=16))


def _dynamic_llama():
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16}
    return _build(transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 16}, rope_parameters=rope))


@pytest.mark.parametrize("build", [_longrope_phi3, _dynamic_llama], ids=["phi3_longrope", "llama_dynamic"])
def test_a_requests_tokens_do_not_depend_on_the_requests_sharing_its_forward(build):
    """Defect: transformers' "longrope" (Phi-3/3.5 128k) and "dynamic" RoPE pick their frequencies from
    max(position_ids) of the forward; the runner packs every request into one row, so a short request batched with
    one past original_max_position_embeddings is rotated with the long frequencies: other tokens than it gets alone
    (and than transformers gives it). Expected: the same tokens alone and batched, or a ConfigError."""
    model = build()
    short, long = _prompts((5, 30))
    want = _hf_greedy(model, short, 8)
    runner = _runner_or_refusal(model)
    if runner is None:
        return
    with runner:
        alone = runner.generate([short], SamplingParams(max_new_tokens=8))[0].tokens
        batched = runner.generate([short, long], SamplingParams(max_new_tokens=8))[0].tokens
    assert alone == want
    assert batched == want


# ---- a model whose attention is not causal -----------------------------------------------------------------------

def test_a_bidirectional_attention_model_is_served_exactly_or_refused():
    """Defect: hwkv attention is always causal and never reads the attention module's `is_causal`; a Gemma 3 text
    model with use_bidirectional_attention=True (EmbeddingGemma's config; also BertLMHeadModel without
    is_decoder) is served causally: its first token differs from transformers' forward (logits 1.3+ off), no
    error. Expected: transformers' first token, or a ConfigError naming the non-causal attention."""
    cfg = transformers.Gemma3TextConfig(**TINY, sliding_window=12, query_pre_attn_scalar=24,
                                        use_bidirectional_attention=True)
    model = _build(cfg)
    prompt = [124, 6, 25, 50, 20, 126, 101, 18]
    with torch.no_grad():
        top2 = model(torch.tensor([prompt])).logits[0, -1].topk(2)
    assert float(top2.values[0] - top2.values[1]) > 0.3  # a decisive reference
    runner = _runner_or_refusal(model)
    if runner is None:
        return
    with runner:
        try:
            got = runner.generate([prompt], SamplingParams(max_new_tokens=1))[0]
        except ConfigError:  # refused at the first forward: fine too
            return
    assert got.tokens == [int(top2.indices[0])]


# ---- models of the wrong kind ------------------------------------------------------------------------------------

def test_a_model_without_an_lm_head_is_refused_with_a_config_error():
    """Defect: HybridRunner(LlamaModel) (AutoModel instead of AutoModelForCausalLM; also a
    ...ForSequenceClassification) ends in a bare AttributeError "'NoneType' object has no attribute 'weight'" from
    `model.get_output_embeddings().weight` (runner.py:112). Expected: ConfigError saying it needs a causal LM,
    the model's attention implementation unchanged."""
    model = transformers.LlamaModel(transformers.LlamaConfig(**TINY)).eval()
    before = model.config._attn_implementation
    with pytest.raises(ConfigError):
        HybridRunner(model, max_running=1, context=32)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("bad", ["/path/to/model", None], ids=["a_path", "none"])
def test_something_that_is_no_model_is_refused_with_a_config_error(bad):
    """Defect: HybridRunner("/path/to/model") (a name or path where load_model's result belongs) or
    HybridRunner(None) raises a bare AttributeError "'str' object has no attribute 'parameters'" (runner.py:68).
    Expected: ConfigError naming what was given (load the model with load_model first)."""
    with pytest.raises(ConfigError):
        HybridRunner(bad)


def test_an_encoder_decoder_model_is_refused_when_the_runner_opens():
    """Defect: HybridRunner(T5ForConditionalGeneration) opens (its attention goes through the interface), then its
    first step raises transformers' bare ValueError "You must specify exactly one of input_ids or inputs_embeds"
    (the runner never passes decoder inputs). Expected: ConfigError from the constructor (config.is_encoder_decoder),
    the model's attention implementation unchanged."""
    cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    before = model.config._attn_implementation
    try:
        with pytest.raises(ConfigError):
            runner = HybridRunner(model, max_running=1, context=32)
            try:
                runner.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
            finally:
                runner.close()
    finally:
        assert model.config._attn_implementation == before


# ---- generate's on_step ------------------------------------------------------------------------------------------

def test_an_on_step_that_is_not_callable_is_refused_before_any_forward():
    """Defect: runner.generate(prompts, params, on_step=5) queues the prompts, runs a forward, then fails with a bare
    TypeError "'int' object is not callable" (engine.py:340). Expected: ConfigError naming on_step before anything
    is queued or run (no forward counted, no request id used)."""
    cfg = transformers.Gemma2Config(**TINY, sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0)
    model = _build(cfg)
    with HybridRunner(model, max_running=2, chunk=8, page_size=4, context=32) as runner:
        with pytest.raises(ConfigError, match="on_step"):
            runner.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), on_step=5)
        assert sum(runner.stats.forwards.values()) == 0
        assert runner.add_request([1, 2], SamplingParams(max_new_tokens=1)) == 0
        runner.check_integrity()
