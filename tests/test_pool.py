"""Pools: the bare-instance write contract, real read-back, head shapes, fp8, untouched inputs, errors."""
import subprocess
import sys
import types

import pytest
import torch

from hwkv.errors import LocError, MissingSWALocError, ShapeError
from hwkv.loc import KVWriteLoc
from hwkv.pool import MHATokenToKVPool, SWAKVPool


class RecordingSubPool:
    """Stands in for a sub-pool and remembers how it was called."""

    def __init__(self):
        self.calls = []

    def set_kv_buffer(self, layer, loc, k, v, k_scale=None, v_scale=None, layer_id_override=None):
        self.calls.append(dict(loc=loc, k=k, v=v, k_scale=k_scale, v_scale=v_scale, layer_id=layer_id_override))


def bare_pool():
    """Only the three attributes the contract allows set_kv_buffer to read."""
    pool = object.__new__(SWAKVPool)
    pool.layers_mapping = {0: (0, True), 1: (0, False), 2: (1, True)}
    pool.full_kv_pool = RecordingSubPool()
    pool.swa_kv_pool = RecordingSubPool()
    return pool


def layer(i):
    return types.SimpleNamespace(layer_id=i)


def test_bare_swa_layer_writes_the_swa_loc_it_was_handed():
    pool = bare_pool()
    loc, swa = torch.tensor([7, 8, 9]), torch.tensor([3, 1, 2])
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    pool.set_kv_buffer(layer(2), KVWriteLoc(loc, swa), k, v, k_scale=0.5, v_scale=0.25)
    call = pool.swa_kv_pool.calls[-1]
    assert call["loc"] is swa and call["layer_id"] == 1
    assert call["k"] is k and call["v"] is v and call["k_scale"] == 0.5 and call["v_scale"] == 0.25
    assert not pool.full_kv_pool.calls


def test_bare_swa_loc_as_keyword_is_used_as_is():
    pool = bare_pool()
    loc, swa = torch.tensor([7, 8]), torch.tensor([5, 6])
    pool.set_kv_buffer(layer(0), loc, torch.zeros(2, 1, 1), torch.zeros(2, 1, 1), swa_loc=swa)
    assert pool.swa_kv_pool.calls[-1]["loc"] is swa


def test_bare_longer_swa_loc_is_trimmed_to_loc():
    pool = bare_pool()
    swa = torch.tensor([5, 6, 0, 0])
    pool.set_kv_buffer(layer(0), KVWriteLoc(torch.tensor([1, 2]), swa), torch.zeros(2, 1, 1), torch.zeros(2, 1, 1))
    got = pool.swa_kv_pool.calls[-1]["loc"]
    assert got.tolist() == [5, 6] and got.data_ptr() == swa.data_ptr()


def test_bare_swa_layer_without_swa_loc_raises():
    pool = bare_pool()
    with pytest.raises(MissingSWALocError) as e:
        pool.set_kv_buffer(layer(0), torch.tensor([1]), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    assert isinstance(e.value, AssertionError)
    assert not pool.swa_kv_pool.calls and not pool.full_kv_pool.calls


def test_missing_swa_loc_raises_under_python_O():
    code = (
        "import torch, types\n"
        "from hwkv.pool import SWAKVPool\n"
        "from hwkv.errors import MissingSWALocError\n"
        "p = object.__new__(SWAKVPool)\n"
        "p.layers_mapping = {0: (0, True)}\n"
        "p.full_kv_pool = p.swa_kv_pool = None\n"
        "try:\n"
        "    p.set_kv_buffer(types.SimpleNamespace(layer_id=0), torch.tensor([1]), None, None)\n"
        "except AssertionError as e:\n"
        "    assert type(e) is MissingSWALocError\n"
        "    print('raised')\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "raised"


def test_bare_full_layer_ignores_swa_loc():
    pool = bare_pool()
    loc = torch.tensor([4, 5])
    pool.set_kv_buffer(layer(1), KVWriteLoc(loc, torch.tensor([9, 9])), torch.zeros(2, 1, 1), torch.zeros(2, 1, 1))
    pool.set_kv_buffer(layer(1), loc, torch.zeros(2, 1, 1), torch.zeros(2, 1, 1), swa_loc=torch.tensor([1]))
    assert [c["loc"] is loc for c in pool.full_kv_pool.calls] == [True, True]
    assert pool.full_kv_pool.calls[0]["layer_id"] == 0 and not pool.swa_kv_pool.calls


def make_hybrid(dtype=torch.float32, **kw):
    return SWAKVPool(64, 16, 1, dtype, 2, 8, swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1], device="cpu", **kw)


def test_real_pool_write_then_read_back():
    pool = make_hybrid()
    loc, swa = torch.tensor([10, 11, 12]), torch.tensor([1, 2, 3])
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    k0, v0 = k.clone(), v.clone()
    pool.set_kv_buffer(layer(2), KVWriteLoc(loc, swa), k, v)
    pool.set_kv_buffer(layer(1), KVWriteLoc(loc, swa), 2 * k, 2 * v)
    assert torch.equal(pool.get_key_buffer(2)[swa], k) and torch.equal(pool.get_value_buffer(2)[swa], v)
    assert torch.equal(pool.get_key_buffer(1)[loc], 2 * k)
    assert pool.get_key_buffer(0).abs().sum() == 0  # the other SWA layer is untouched
    assert torch.equal(k, k0) and torch.equal(v, v0)


def test_swa_group_with_its_own_head_shapes():
    pool = make_hybrid(swa_head_num=4, swa_head_dim=16, swa_v_head_dim=12, v_head_dim=8)
    assert pool.get_key_buffer(0).shape == (17, 4, 16) and pool.get_value_buffer(0).shape == (17, 4, 12)
    assert pool.get_key_buffer(1).shape == (65, 2, 8)
    k, v = torch.randn(2, 4, 16), torch.randn(2, 4, 12)
    pool.set_kv_buffer(layer(0), KVWriteLoc(torch.tensor([3, 4]), torch.tensor([5, 6])), k, v)
    assert torch.equal(pool.get_value_buffer(0)[torch.tensor([5, 6])], v)
    with pytest.raises(ShapeError, match="cache_k"):
        pool.set_kv_buffer(layer(1), torch.tensor([3, 4]), k, v)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_round_trip_with_scales_leaves_inputs_alone(dtype):
    pool = MHATokenToKVPool(32, 1, dtype, 2, 8, 1, "cpu")
    k, v = torch.randn(4, 2, 8) * 3, torch.randn(4, 2, 8) * 3
    k0, v0 = k.clone(), v.clone()
    loc = torch.tensor([1, 5, 9, 13])
    pool.set_kv_buffer(layer(0), loc, k, v, k_scale=0.5, v_scale=2.0)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    back_k = pool.get_key_buffer(0)[loc].float() * 0.5
    back_v = pool.get_value_buffer(0)[loc].float() * 2.0
    rel = 2 ** -3 if dtype == torch.float8_e4m3fn else 2 ** -2  # mantissa bits 3 / 2
    assert ((back_k - k).abs() <= k.abs() * rel + 0.5 * 2 ** -6).all()
    assert ((back_v - v).abs() <= v.abs() * rel + 2.0 * 2 ** -6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_half_and_float_pools(dtype):
    pool = MHATokenToKVPool(16, 4, dtype, 1, 4, 2, "cpu")
    k = torch.randn(2, 1, 4)
    pool.set_kv_buffer(layer(1), torch.tensor([4, 5]), k, k)
    assert torch.equal(pool.get_key_buffer(1)[4:6], k.to(dtype))


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([1, 2], dtype=torch.int32), "int64"),
    (torch.tensor([1, 70]), r"\[1, 70\].*\[0, 65\)"),
    (torch.tensor([[1, 2]]), "1-D"),
])
def test_bad_loc_raises_and_leaves_pool_unchanged(bad, match):
    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 8, 1, "cpu")
    before = pool.get_key_buffer(0).clone()
    with pytest.raises(LocError, match=match):
        pool.set_kv_buffer(layer(0), bad, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    assert torch.equal(before, pool.get_key_buffer(0))


def test_kv_shape_mismatch_names_the_shape():
    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 8, 1, "cpu")
    with pytest.raises(ShapeError, match=r"cache_k has shape \[2, 3, 8\], expected \[2, 2, 8\]"):
        pool.set_kv_buffer(layer(0), torch.tensor([1, 2]), torch.ones(2, 3, 8), torch.ones(2, 2, 8))
    assert pool.get_key_buffer(0).abs().sum() == 0


def test_swa_loc_shorter_than_loc_is_refused():
    with pytest.raises(LocError, match="shorter"):
        KVWriteLoc(torch.tensor([1, 2, 3]), torch.tensor([1]))


def test_translate_is_a_plain_int64_gather():
    from hwkv.allocator import SWATokenToKVPoolAllocator
    pool = make_hybrid()
    alloc = SWATokenToKVPoolAllocator(64, 16, 1, "cpu", pool)
    loc = alloc.alloc(3)
    swa = pool.translate_loc_from_full_to_swa(loc)
    assert swa.dtype == torch.int64 and torch.equal(swa, alloc.full_to_swa_index_mapping[loc])
    assert int(pool.translate_loc_from_full_to_swa(torch.tensor([-1]))) == -1
    pool.check_integrity()
