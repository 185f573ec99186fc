"""Re-review of review 36's fixes (`git diff 0956311..HEAD`): fixes that refuse valid input which used to work, and
a fix that left a sibling entry point open.

Each test fails on the code as re-reviewed and passes once the defect is fixed; each docstring names the defect.
Tiny random transformers models, fp32 on the CPU, nothing downloaded (as tests/test_review36_hf.py).
"""
from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")

from hwkv.errors import ConfigError  # noqa: E402
from hwkv.integrations.transformers import HybridRunner, SamplingParams  # noqa: E402
from hwkv.layer import AttentionLayer  # noqa: E402
from hwkv.testing.harness import Harness  # noqa: E402
from test_review36_hf import _build, _hf_greedy, _prompts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
            tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)


# ---- check_servable: a position-dependent RoPE inside the window where it is not --------------------------------

def _longrope_phi3():
    """Phi-3.5-mini / Phi-3-128k / Phi-4-mini in small: longrope, original window 32 of 256 positions."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0 + i for i in range(8)], "original_max_position_embeddings": 32}
    return _build(transformers.Phi3Config(**TINY, rope_parameters=rope, original_max_position_embeddings=32))


def _dynamic_llama():
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 8.0}
    return _build(transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 32}, rope_parameters=rope))


@pytest.mark.parametrize("build", [_longrope_phi3, _dynamic_llama], ids=["phi3_longrope", "llama_dynamic"])
def test_position_dependent_rope_is_served_where_no_position_passes_its_original_window(build):
    """Defect: check_servable (hf_model.py:62-70) refuses every 'longrope' / 'dynamic' RoPE, whatever the context.
    transformers switches their frequencies only once max(position_ids) + 1 passes original_max_position_embeddings
    (longrope) / max_position_embeddings (dynamic); with context <= that bound (Phi-3.5-mini's default context 4096
    is its original 4096) every forward uses the fixed short frequencies, and before the fix the runner gave
    transformers' tokens alone and batched. Expected: no ConfigError at context=32 and transformers' tokens (refuse
    only a context past the bound)."""
    model = build()
    short, long = _prompts((5, 20))
    want = [_hf_greedy(model, p, 8) for p in (short, long)]
    with HybridRunner(model, max_running=4, chunk=64, page_size=4, context=32) as runner:
        got = runner.generate([short, long], SamplingParams(max_new_tokens=8))
    assert [r.tokens for r in got] == want


# ---- check_servable: a compiled model ----------------------------------------------------------------------------

def test_a_torch_compiled_model_is_still_served():
    """Defect: check_servable (hf_model.py:50-57) reads position_ids from inspect.signature(model.forward); a
    torch.compile(model) (OptimizedModule, forward (*args, **kwargs)) is refused with 'OptimizedModule.forward takes
    no position_ids', although it passes position_ids on to the model and before the fix the runner served it with
    transformers' tokens. Expected: no ConfigError and transformers' tokens (read the signature of the module
    torch.compile wraps, `_orig_mod`)."""
    model = _build(transformers.LlamaConfig(**TINY))
    prompt = _prompts((5,))[0]
    want = _hf_greedy(model, prompt, 4)
    compiled = torch.compile(model, backend="eager")
    with HybridRunner(compiled, max_running=2, chunk=32, page_size=4, context=32, graphs=False) as runner:
        got = runner.generate([prompt], SamplingParams(max_new_tokens=4))[0]
    assert got.error is None and got.tokens == want


# ---- Harness.compare: the tolerance check's sibling entry point --------------------------------------------------

@pytest.mark.parametrize("tol", [float("nan"), "1e-3"], ids=["nan", "str"])
def test_harness_compare_refuses_a_tolerance_that_is_no_finite_number(tol):
    """Defect: row 277's fix checks Harness(tolerance=), forward(atol=) and check_outputs(atol=) but not the public
    Harness.compare(layer, got, ref, what, tol) (harness.py:456, which spec_harness and callers' own checks use):
    tol=nan passes an output 1.0 off the reference (err > nan is False), tol='1e-3' is a bare TypeError. Expected:
    ConfigError naming the tolerance (`_check_tolerance`), as forward(atol=nan) gets."""
    fake = types.SimpleNamespace(tolerance=1e-3, max_err=0.0)
    with pytest.raises(ConfigError, match="tol"):
        Harness.compare(fake, AttentionLayer(0, 2, 1, 4), torch.ones(3, 2, 4), torch.zeros(3, 2, 4), "check", tol)
