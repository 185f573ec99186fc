"""Review 31 re-review: holes left by review 31's fixes (engine `_finishing` / cache_prompts lock, hf_model's
per-layer fields and position limit). Every test here fails on the code it was written against; each docstring names
the defect, expected vs actual, and file:line."""
from __future__ import annotations

import signal
from typing import List

import pytest
import torch

from hwkv.engine.sampling import SamplingParams
from hwkv.errors import HwkvError
from test_review31_pressure import _drain, _engine, _run, _tokens

transformers = pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def _sigint_in_first_call(monkeypatch, owner, name: str, after: bool) -> List[int]:
    """`owner.name` sends the process a real SIGINT in its first call (Ctrl-C), as it starts or once it has run
    (`after`); later calls run as usual. The list it appends to when it fired."""
    original, fired = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        if not fired and not after:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)
        out = original(*args, **kwargs)
        if not fired:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(owner, name, interrupted)
    return fired


@pytest.mark.parametrize("where", ["as_the_lock_moves", "after_the_unlocked_caching"])
def test_ctrl_c_between_the_last_prompt_chunks_caching_and_its_lock_does_not_over_commit(monkeypatch, where,
                                                                                         python_sigint):
    """Defect: review 31 put the lock of a prompt chunk's cached nodes (`cache_prompts(rows, lock=True)` ->
    `HybridPrefixCache.cache_running`) in a `finally` after the release (hwkv/engine/engine.py:441-444) so a Ctrl-C
    in the RELEASE of a prompt's last chunk still locks them; but the hand-over from the unlocked caching
    (`cache_prompts(rows, lock=False)`, engine.py:440 -> prefixing.py:136) to that lock is not held against Ctrl-C
    (no `interrupts_held`, as `_finish_pending` has): a Ctrl-C landing as the lock's own caching starts
    (`cache_running`, prefixing.py:139, before it changed anything) or right after the unlocked caching returned
    skips the lock, and no later step catches it up (`cache_prompts` only visits rows still in their prompt,
    prefixing.py:133). The request's prompt pages sit in unlocked nodes, counted evictable, while it holds them, and
    admission over-commits: the defect review 31's pressure test 1 pins, one statement away.
    Fixed: on prefill steps the caching, the release and the lock run with Ctrl-C held (a real SIGINT here, raised
    once they landed). Expected: the interrupted run ends with the tokens of the run without the prefix cache, no
    step error.
    Actual: every later step raises OutOfSlotsError "a forward needs 1 pages in the full pool, 0 are free and the
    prefix cache holds nothing evictable: admission reserved less than the running requests take (a bug)". Same pool
    and prompts as review 31's pressure test 1 (26 full pages of 4; two 40-token prompts, 20 new tokens)."""
    a, b = _tokens(40, 5), _tokens(40, 6)
    want = _run(_engine(chunk=48, full_pages=26, max_running=2, prefix_cache=False), [a, b], new=20)
    e = _engine(chunk=48, full_pages=26, max_running=2)
    if where == "as_the_lock_moves":
        fired = _sigint_in_first_call(monkeypatch, e.prefix, "cache_running", after=False)
    else:
        fired = _sigint_in_first_call(monkeypatch, e._prefixing, "cache_prompts", after=True)
    rids = [e.add_request(p, SamplingParams(max_new_tokens=20)) for p in (a, b)]
    out, errors = _drain(e)
    assert fired, "the prompt caching was never reached"
    assert not errors, "\n".join(errors)
    assert [out.get(r) for r in rids] == want


needs_step3p7 = pytest.mark.skipif(not hasattr(transformers, "Step3p7TextConfig"),
                                   reason="this transformers has no Step 3.7 model")


@needs_step3p7
def test_a_config_with_per_layer_attention_heads_gets_a_shape_or_an_hwkv_error():
    """Defect: review 31's fix for Gemma 4 (`hf_model._by_kind`, hwkv/integrations/hf_model.py:86-104) reads only
    head_dim and num_key_value_heads per layer kind; `model_shape` still reads `int(cfg.num_attention_heads)` from the
    global config (hf_model.py:115). transformers 5 keeps num_attention_heads per layer for Step 3.7 (its
    `num_sliding_attention_heads`, a per_layer_config override on the sliding layers: a hybrid SWA/full model, the
    kind hwkv serves), and the global config's attribute access raises transformers'
    AmbiguousGlobalPerLayerAttributeError (a RuntimeError) for a per-layer field: the very failure review 31 fixed for
    Gemma 4's head_dim (HybridRunner / `hwkv generate` end in that traceback). Expected: a ModelShape (hwkv keeps no
    per-kind query-head count, the KV geometry is the same) or an hwkv ConfigError naming the field. Actual:
    AmbiguousGlobalPerLayerAttributeError."""
    from hwkv.integrations.hf_model import model_shape

    cfg = transformers.Step3p7TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        num_sliding_attention_heads=8, max_position_embeddings=256)
    assert "num_attention_heads" in (cfg.per_layer_attributes or ())  # (transformers keeps it per layer)
    try:
        shape = model_shape(cfg, torch.float32)
    except HwkvError:
        return  # refused with hwkv's own error: fine
    assert shape.layer_is_swa == (True, False) and shape.window == 8
