"""Preset geometry and byte arithmetic, checked against hand computation from the published configs."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from hwkv.engine.presets import (PRESETS, ModelShape, add_model_arguments, custom_shape, get_preset,
                                 layer_pattern, shape_from_args)
from hwkv.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser.parse_args(list(argv))


def test_table_holds_the_five_models_each_with_a_source():
    assert set(PRESETS) == {"gpt-oss-20b", "gpt-oss-120b", "gemma-2-27b", "gemma-3-27b", "mimo-v2-flash"}
    for name, shape in PRESETS.items():
        assert shape.name == name and "config.json" in shape.source
        assert sorted(shape.swa_layer_ids + shape.full_layer_ids) == list(range(shape.num_layers))


def test_gpt_oss_120b_bytes_per_token():
    s = PRESETS["gpt-oss-120b"]
    assert s.num_layers == 36 and s.window == 128 and s.sinks and s.swa_sinks
    assert s.swa_layer_ids == tuple(range(0, 36, 2))          # sliding first, alternating
    assert s.full_layer_ids == tuple(range(1, 36, 2))
    # 18 full layers x 8 kv heads x (64 K + 64 V) dims x 2 bytes = 36864 bytes per token
    assert s.bytes_per_token_full_group == 18 * 8 * (64 + 64) * 2 == 36864
    assert s.bytes_per_token_swa_group == 18 * 8 * (64 + 64) * 2 == 36864
    assert s.bytes_per_token_all_full == 36 * 8 * 128 * 2 == 73728
    # 73728 * 131072 / (36864 * 131072 + 36864 * 128) = 2 * 131072 / 131200
    assert s.saving_limit(131072) == pytest.approx(2 * 131072 / 131200)


def test_gpt_oss_20b_bytes_per_token():
    s = PRESETS["gpt-oss-20b"]
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (24, 64, 8, 64)
    assert s.bytes_per_token_full_group == 12 * 8 * 128 * 2 == 24576
    assert s.bytes_per_token_swa_group == 24576


def test_gemma_3_27b_pattern_bytes_and_closed_form():
    s = PRESETS["gemma-3-27b"]
    assert s.full_layer_ids == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)
    assert len(s.swa_layer_ids) == 52 and s.window == 1024 and s.logit_cap == 0.0
    assert s.layer_is_swa == layer_pattern(62, "sssssf")
    per_layer = 16 * (128 + 128) * 2                           # 8192 bytes per token per layer
    assert s.bytes_per_token_full_group == 10 * per_layer == 81920
    assert s.bytes_per_token_swa_group == 52 * per_layer == 425984
    assert s.bytes_per_token_all_full == 62 * per_layer == 507904
    # 62 * 32768 / (10 * 32768 + 52 * 1024) = 2031616 / 380928 = 16/3
    assert s.saving_limit(32768) == pytest.approx(62 * 32768 / (10 * 32768 + 52 * 1024))
    assert s.saving_limit(32768) == pytest.approx(16 / 3)
    assert s.scaling == pytest.approx(168 ** -0.5)


def test_gemma_2_27b_sliding_first_softcap_and_short_context():
    s = PRESETS["gemma-2-27b"]
    assert s.swa_layer_ids[:3] == (0, 2, 4) and len(s.full_layer_ids) == 23
    assert s.logit_cap == 50.0 and s.window == 4096
    assert s.bytes_per_token_full_group == 23 * 16 * 256 * 2 == 188416
    # context <= W: the hybrid cache keeps every token too, no saving
    assert s.saving_limit(4096) == pytest.approx(1.0)
    assert s.saving_limit(131072) == pytest.approx(46 * 131072 / (23 * 131072 + 23 * 4096))


def test_mimo_v2_flash_separate_swa_geometry():
    s = PRESETS["mimo-v2-flash"]
    assert s.full_layer_ids == (0, 5, 11, 17, 23, 29, 35, 41, 47) and len(s.swa_layer_ids) == 39
    # full: 4 kv heads x (192 K + 128 V) x 2 bytes = 2560 per layer; SWA: 8 x 320 x 2 = 5120
    assert s.bytes_per_token_full_group == 9 * 4 * (192 + 128) * 2 == 23040
    assert s.bytes_per_token_swa_group == 39 * 8 * (192 + 128) * 2 == 199680
    assert s.bytes_per_token_all_full == 23040 + 199680
    assert s.saving_limit(131072) == pytest.approx(222720 * 131072 / (23040 * 131072 + 199680 * 128))
    assert s.layer(0) == (64, 4, 192, 128, None, False)
    assert s.layer(1) == (64, 8, 192, 128, 128, True)
    kw = s.pool_kwargs()
    assert (kw["head_num"], kw["head_dim"], kw["v_head_dim"]) == (4, 192, 128)
    assert (kw["swa_head_num"], kw["swa_head_dim"], kw["swa_v_head_dim"]) == (8, 192, 128)
    assert kw["full_attention_layer_ids"] == list(s.full_layer_ids)


def test_shape_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["gemma-3-27b"].window = 1  # type: ignore[misc]


def test_custom_shape_from_flags():
    s = shape_from_args(_args("--layers", "12", "--window", "256", "--heads", "16", "--kv-heads", "4",
                              "--head-dim", "128", "--full-every", "3", "--sinks", "swa", "--kv-dtype", "fp8"))
    assert s.full_layer_ids == (2, 5, 8, 11) and s.window == 256
    assert (s.sinks, s.swa_sinks, s.dtype_bytes) == (False, True, 1)
    assert s.bytes_per_token_full_group == 4 * 4 * 256 * 1
    assert custom_shape(layers=4, window=8, heads=2, kv_heads=1, head_dim=4).swa_layer_ids == (0, 2)


def test_preset_overrides_follow_derived_fields():
    g = shape_from_args(_args("--model", "gemma-3-27b", "--head-dim", "256", "--window", "512"))
    assert (g.head_dim, g.swa_head_dim, g.swa_v_head_dim, g.window) == (256, 256, 256, 512)
    assert g.full_layer_ids == PRESETS["gemma-3-27b"].full_layer_ids
    m = shape_from_args(_args("--model", "mimo-v2-flash", "--kv-heads", "8"))
    assert (m.num_kv_heads, m.swa_num_kv_heads, m.v_head_dim) == (8, 8, 128)
    assert shape_from_args(_args("--model", "gpt-oss-20b")) is PRESETS["gpt-oss-20b"]
    assert shape_from_args(_args("--model", "gpt-oss-20b", "--layers", "6", "--pattern", "sf")).num_layers == 6


@pytest.mark.parametrize("call, words", [
    (lambda: layer_pattern(4, "sx"), "'sx'"),
    (lambda: layer_pattern(4, "sf", 2), "not both"),
    (lambda: layer_pattern(2, "sssf"), "4 entries"),
    (lambda: custom_shape(layers=2, window=8, heads=6, kv_heads=4, head_dim=8), "num_heads=6"),
    (lambda: custom_shape(layers=2, window=0, heads=4, kv_heads=4, head_dim=8), "window"),
    (lambda: get_preset("llama"), "'llama'"),
    (lambda: shape_from_args(_args("--layers", "4")), "--window"),
    (lambda: shape_from_args(_args("--model", "gemma-3-27b", "--layers", "12")), "--pattern"),
])
def test_bad_shapes_raise_config_error_naming_the_value(call, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        call()


def test_all_full_custom_shape_has_no_swa():
    s = ModelShape(name="dense", layer_is_swa=(False,) * 4, window=0, num_heads=8, num_kv_heads=8, head_dim=64)
    assert s.swa_layer_ids == () and s.bytes_per_token_swa_group == 0
    assert s.saving_limit(1000) == 1.0
