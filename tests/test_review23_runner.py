"""Review 23 (the transformers integration): a HybridRunner dropped without `close()` (no `with`, an exception in the
caller's code) gives its count back when it is collected, so the last runner to go still gives the model back its own
attention; it had left the model on hwkv attention for good (every plain forward a ConfigError)."""
import gc

import pytest
import torch

from hwkv.engine.sampling import SamplingParams
from test_engine_defects import tiny_gemma2  # noqa: F401 - the tiny Gemma-2 fixture (eager attention)


@pytest.mark.parametrize("then", ["a later runner closes", "none"])
def test_a_runner_dropped_without_close_gives_the_model_its_attention_back(tiny_gemma2, then):
    from hwkv.integrations.transformers import HybridRunner
    m = tiny_gemma2
    r = HybridRunner(m, max_running=1, context=16, page_size=4)
    r.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert m.config._attn_implementation != "eager"
    del r
    gc.collect()
    if then == "none":
        assert m.config._attn_implementation == "eager"
    else:
        with HybridRunner(m, max_running=1, context=16, page_size=4) as r2:
            r2.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
            assert m.config._attn_implementation != "eager"
        assert m.config._attn_implementation == "eager"
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]))   # the model runs on its own


def test_a_closed_runner_collected_later_gives_nothing_back_twice(tiny_gemma2):
    """close() then collection: the count drops once (a second drop would hand a still-open runner's model back)."""
    from hwkv.integrations.transformers import HybridRunner
    m = tiny_gemma2
    keep = HybridRunner(m, max_running=1, context=16, page_size=4)
    r = HybridRunner(m, max_running=1, context=16, page_size=4)
    r.close()
    del r
    gc.collect()
    assert m.config._attn_implementation != "eager"   # `keep` is still open
    keep.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    keep.close()
    assert m.config._attn_implementation == "eager"
