"""Review 27 (model geometry): the SWA layers' V head dim, where none is given, is one rule everywhere.

Before: `ModelShape(head_dim=192, v_head_dim=128)` gave its SWA layers a V head dim of 192 (it followed the SWA K
head dim), while `SWAKVPool(head_dim=192, v_head_dim=128)` and a Hugging Face config gave them 128: `hwkv plan` and
`bench` overstated SWA bytes for a custom shape with only `--v-head-dim`. Now `hwkv.pool.default_swa_v_head_dim`
decides for all three: the full layers' V head dim while the SWA layers keep the full K head dim, else their own K
head dim."""
import argparse
import types

import pytest
import torch

from hwkv.engine.presets import ModelShape, add_model_arguments, shape_from_args
from hwkv.pool import SWAKVPool, default_swa_v_head_dim

# (head_dim, v_head_dim, swa_head_dim or None) -> the SWA V head dim every path gives
CASES = [((192, 128, None), 128), ((192, 128, 192), 128), ((192, 128, 64), 64), ((64, 64, None), 64),
         ((64, 32, 48), 48)]


@pytest.mark.parametrize("dims, want", CASES)
def test_model_shape_pool_and_hf_config_agree(dims, want):
    d, dv, swa_d = dims
    shape = ModelShape(name="m", layer_is_swa=(True, False), window=4, num_heads=4, num_kv_heads=2, head_dim=d,
                       v_head_dim=dv, swa_head_dim=swa_d)
    pool = SWAKVPool(8, 8, 1, torch.float32, 2, d, [0], [1], "cpu", v_head_dim=dv, swa_head_dim=swa_d)
    assert shape.swa_v_head_dim == want
    assert pool.swa_kv_pool.v_head_dim == want
    assert default_swa_v_head_dim(d, dv, d if swa_d is None else swa_d) == want
    hf = pytest.importorskip("hwkv.integrations.hf_model")
    cfg = types.SimpleNamespace(model_type="toy", num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                                v_head_dim=dv, hidden_size=4 * d, sliding_window=4, num_hidden_layers=2,
                                layer_types=["sliding_attention", "full_attention"])
    if swa_d is not None:
        cfg.swa_head_dim = swa_d
    assert hf.model_shape(cfg, torch.bfloat16).swa_v_head_dim == want


def test_an_overridden_v_head_dim_carries_to_the_swa_layers():
    """`--model gpt-oss-20b --v-head-dim 32`: the SWA V head dim merely followed the default, so it moves too; with
    `--swa-head-dim 48` as well it follows that; one given explicitly stays."""
    ap = argparse.ArgumentParser()
    add_model_arguments(ap)

    def shape(*argv):
        return shape_from_args(ap.parse_args(["--model", "gpt-oss-20b", *argv]))
    assert shape("--v-head-dim", "32").swa_v_head_dim == 32
    assert shape("--v-head-dim", "32", "--swa-head-dim", "48").swa_v_head_dim == 48
    assert shape("--v-head-dim", "32", "--swa-v-head-dim", "16").swa_v_head_dim == 16
