"""Pools: the bare-instance write contract, real read-back, head shapes, fp8, untouched inputs, errors."""
import subprocess
import sys
import types

import pytest
import torch

from hwkv.errors import ConfigError, DeviceError, LocError, MissingSWALocError, ShapeError
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


# ------------------------------------------- refusals: typed, one line, naming the value and the limit


def snapshot(pool):
    """Every K/V buffer of a pool (either kind), cloned."""
    groups = [pool.full_kv_pool, pool.swa_kv_pool] if isinstance(pool, SWAKVPool) else [pool]
    return [b.clone() for g in groups for b in (*g.k_buffer, *g.v_buffer)]


def unchanged(pool, before):
    return all(torch.equal(a, b) for a, b in zip(before, snapshot(pool)))


@pytest.mark.parametrize("src", [torch.float64, torch.int32, torch.complex64])
def test_kv_of_a_dtype_the_pool_would_cast_lossily_is_refused(src):
    pool = make_hybrid(torch.bfloat16)
    before = snapshot(pool)
    k = torch.ones(2, 2, 8, dtype=src)
    for lid, wl in ((1, torch.tensor([3, 4])), (0, KVWriteLoc(torch.tensor([3, 4]), torch.tensor([5, 6])))):
        with pytest.raises(ShapeError, match=rf"cache_k is {src}, the pool stores torch.bfloat16: a lossy cast .*"
                                             r"pass one of .*torch.float32"):
            pool.set_kv_buffer(layer(lid), wl, k, torch.ones(2, 2, 8, dtype=torch.bfloat16))
        with pytest.raises(ShapeError, match=rf"cache_v is {src}"):
            pool.set_kv_buffer(layer(lid), wl, torch.ones(2, 2, 8, dtype=torch.bfloat16), k)
    assert unchanged(pool, before)


@pytest.mark.parametrize("pool_dtype, src", [
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16),
    (torch.float16, torch.float32), (torch.bfloat16, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.bfloat16),
    (torch.float8_e5m2, torch.float32),
])
def test_working_dtypes_and_lossless_casts_are_written(pool_dtype, src):
    pool = MHATokenToKVPool(16, 4, pool_dtype, 1, 4, 1, "cpu")
    k = torch.full((2, 1, 4), 1.5).to(src)
    pool.set_kv_buffer(layer(0), torch.tensor([4, 5]), k, k)
    assert torch.equal(pool.get_key_buffer(0)[4:6].float(), k.float())


def test_float64_into_a_float32_pool_is_refused_too():
    pool = MHATokenToKVPool(16, 4, torch.float32, 1, 4, 1, "cpu")
    with pytest.raises(ShapeError, match="cache_k is torch.float64, the pool stores torch.float32"):
        pool.set_kv_buffer(layer(0), torch.tensor([4]), torch.ones(1, 1, 4, dtype=torch.float64),
                           torch.ones(1, 1, 4))
    assert pool.get_key_buffer(0).abs().sum() == 0


def test_a_layer_id_the_pool_lacks_names_it_and_the_pools_ids():
    pool = make_hybrid()
    before = snapshot(pool)
    k = torch.ones(2, 2, 8)
    with pytest.raises(ConfigError, match=r"layer_id 5 is in neither group of the pool; its layer ids are \[0, 1, 2\]"):
        pool.set_kv_buffer(layer(5), KVWriteLoc(torch.tensor([3, 4]), torch.tensor([5, 6])), k, k)
    with pytest.raises(ConfigError, match=r"layer_id 5 is in neither group; known ids \[0, 1, 2\]"):
        pool.get_key_buffer(5)
    bare = bare_pool()  # the bare-instance contract: the check reads only layers_mapping
    with pytest.raises(ConfigError, match=r"layer_id 7.*\[0, 1, 2\]"):
        bare.set_kv_buffer(layer(7), torch.tensor([1]), k[:1], k[:1])
    assert not bare.full_kv_pool.calls and not bare.swa_kv_pool.calls
    assert unchanged(pool, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_device_without_its_runtime_is_a_device_error(device):
    with pytest.raises(DeviceError, match=rf"device='{device}': torch.cuda.is_available\(\) is False"):
        SWAKVPool(64, 16, 16, torch.bfloat16, 2, 8, [0], [1], device=device)
    with pytest.raises(DeviceError, match="is_available"):
        MHATokenToKVPool(64, 16, torch.bfloat16, 2, 8, 1, device)


def test_a_device_name_torch_does_not_know_is_a_device_error():
    with pytest.raises(DeviceError, match=r"device='gpu0' is not a torch device"):
        SWAKVPool(64, 16, 16, torch.bfloat16, 2, 8, [0], [1], device="gpu0")


def test_a_pool_larger_than_the_device_is_refused_before_allocating(monkeypatch):
    # (2**40 + 16) full rows and 32 SWA rows of 2 heads x (8 + 8) dims x 2 bytes = 2**46 + 3072 bytes
    with pytest.raises(ConfigError, match=r"SWAKVPool\(size=1099511627776, size_swa=16, 1 full \+ 1 SWA layers\) "
                                          r"needs 70368744180736 bytes \(64.00 TiB\) for its K/V buffers; cpu has \d+ "
                                          r"bytes \(.*\) free"):
        SWAKVPool(2**40, 16, 16, torch.bfloat16, 2, 8, [0], [1], device="cpu")
    import hwkv.pool as pool_mod

    # deterministic: a device with 1 MiB free; a pool of 4 MiB is refused before any buffer exists
    monkeypatch.setattr(pool_mod, "device_free_bytes", lambda device: 2**20)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("a buffer was allocated before the check"))
    with pytest.raises(ConfigError, match=r"MHATokenToKVPool\(size=16368, 2 layers\) needs 4194304 bytes \(4.00 MiB\) "
                                          r"for its "
                                          r"K/V buffers; cpu has 1048576 bytes \(1.00 MiB\) free"):
        MHATokenToKVPool(1024 * 16 - 16, 16, torch.float32, 4, 4, 2, "cpu")
    with pytest.raises(ConfigError, match=r"SWAKVPool\(size=8192, size_swa=8192, 1 full \+ 1 SWA layers\) needs"):
        SWAKVPool(8192, 8192, 16, torch.float32, 4, 8, [0], [1], device="cpu")
