"""Review 37 (plan_cli area): the pool planner's public functions and the model shapes it prices. Each test is a
minimal failing reproduction of one defect; it states the correct behaviour and passes once the defect is fixed."""
from __future__ import annotations

import pytest

from hwkv.engine.plan import bytes_needed, chunk_reserve_tokens
from hwkv.engine.pools import kv_bytes_needed
from hwkv.engine.presets import ModelShape, get_preset, layer_pattern
from hwkv.errors import ConfigError

GPT_OSS = get_preset("gpt-oss-20b")
_TINY = dict(name="t", window=8, num_heads=2, num_kv_heads=1, head_dim=4)


@pytest.mark.parametrize("fn", [bytes_needed, kv_bytes_needed], ids=["bytes_needed", "kv_bytes_needed"])
def test_bytes_needed_refuses_a_truthy_string_prefix_cache(fn):
    """bytes_needed (and pools.kv_bytes_needed) read prefix_cache='no' as on and price the cache lock (418,381,824
    bytes instead of 411,303,936), where plan() and plan_pools refuse it: ConfigError naming prefix_cache."""
    with pytest.raises(ConfigError, match="prefix_cache"):
        fn(GPT_OSS, 4096, 16, 2, 8192, prefix_cache="no")


@pytest.mark.parametrize("running, chunk, word", [(-3, 8192, "running"), (2.5, 8192, "running"),
                                                  (None, 8192, "running"), (2, -8192, "chunk")])
def test_bytes_needed_checks_its_counts_as_plan_does(running, chunk, word):
    """bytes_needed takes none of plan()'s checks: running=-3 answers -614,989,824 bytes, 2.5 a float, a chunk of
    -8192 a budget 8.6 MB for two 4096-token requests (plan refuses all of them), None a bare TypeError.
    Expected: ConfigError naming the count, as plan()'s `max_running` / `chunk` refusals."""
    with pytest.raises(ConfigError, match=word):
        bytes_needed(GPT_OSS, 4096, 16, running, chunk)


def test_chunk_reserve_tokens_refuses_a_negative_chunk():
    """chunk_reserve_tokens (a public planner function) answers a negative reserve, -32 SWA slots, for chunk=-40:
    expected ConfigError naming chunk (plan() refuses chunk < 1)."""
    with pytest.raises(ConfigError, match="chunk"):
        chunk_reserve_tokens(GPT_OSS, -40, 1, 4096, 16)


def test_model_shape_refuses_a_pattern_string_as_layer_is_swa():
    """ModelShape(layer_is_swa='ff') reads every character as truthy: two SLIDING layers, the opposite of what the
    'f' pattern letters (layer_pattern's) say, and plan() prices that shape. Expected: ConfigError naming
    layer_is_swa (a sequence of bools; layer_pattern('ff') makes one)."""
    with pytest.raises(ConfigError, match="layer_is_swa"):
        ModelShape(layer_is_swa="ff", **_TINY)


def test_model_shape_refuses_a_non_bool_sinks():
    """ModelShape(sinks='none') (custom_shape's spelling) keeps the string: every layer's geometry then says sinks
    'none', truthy, and the synthetic model / bench build sink layers. Expected: ConfigError naming sinks."""
    with pytest.raises(ConfigError, match="sinks"):
        ModelShape(layer_is_swa=(True, False), sinks="none", **_TINY)


@pytest.mark.parametrize("call", [lambda: layer_pattern(4, full_every=2.5), lambda: layer_pattern(4.0),
                                  lambda: layer_pattern("4")],
                         ids=["full_every=2.5", "layers=4.0", "layers='4'"])
def test_layer_pattern_refuses_non_integer_counts(call):
    """layer_pattern(4, full_every=2.5) answers four sliding layers (no (i+1) % 2.5 is 0); layer_pattern(4.0) and
    layer_pattern('4') end in bare TypeErrors. Expected: ConfigError naming the value (it refuses 0 that way)."""
    with pytest.raises(ConfigError):
        call()


@pytest.mark.parametrize("context", [None, "4096", 2.5])
def test_saving_limit_refuses_a_non_integer_context(context):
    """ModelShape.saving_limit(None) / ('4096') are bare TypeErrors and (2.5) answers a ratio for a fraction of a
    token; it refuses context=0 with ConfigError, so these should be ConfigError naming context too."""
    with pytest.raises(ConfigError, match="context"):
        GPT_OSS.saving_limit(context)

