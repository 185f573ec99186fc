"""KVWriteLoc and SWALocCache: trimming, identity, once-per-forward translation, graph buffer refill."""
import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.errors import CapacityError, LocError
from hwkv.loc import KVWriteLoc, SWALocCache
from hwkv.pool import MHATokenToKVPool, SWAKVPool


def test_equal_length_swa_loc_is_the_same_object():
    loc, swa = torch.tensor([1, 2]), torch.tensor([3, 4])
    w = KVWriteLoc(loc, swa)
    assert w.loc is loc and w.swa_loc is swa and len(w) == 2


def test_longer_swa_loc_is_trimmed_view_and_shorter_refused():
    swa = torch.tensor([3, 4, 0, 0])
    w = KVWriteLoc(torch.tensor([1, 2]), swa)
    assert w.swa_loc.tolist() == [3, 4] and w.swa_loc.data_ptr() == swa.data_ptr()
    with pytest.raises(LocError, match="2 entries, shorter than loc's 3"):
        KVWriteLoc(torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
    with pytest.raises(LocError, match="int64"):
        KVWriteLoc(torch.tensor([1, 2], dtype=torch.int32))


def hybrid():
    pool = SWAKVPool(64, 16, 1, torch.float32, 1, 4, [0], [1], "cpu")
    alloc = SWATokenToKVPoolAllocator(64, 16, 1, "cpu", pool)
    return pool, alloc


def test_eager_translation_once_and_held():
    pool, alloc = hybrid()
    loc = alloc.alloc(5)
    cache = SWALocCache(pool)
    swa = cache.translate(loc)
    assert cache.translations == 1 and cache.current is swa
    assert torch.equal(swa, alloc.full_to_swa_index_mapping[loc])


def test_graph_refill_zeroes_the_tail_and_returns_the_live_view():
    pool, alloc = hybrid()
    cache = SWALocCache(pool)
    cache.alloc_graph_buffer(8, torch.device("cpu"))
    big = alloc.alloc(6)
    v = cache.refill(big)
    assert v.data_ptr() == cache.buffer.data_ptr() and v.shape == (6,)
    small = alloc.alloc(2)
    v2 = cache.refill(small)
    assert torch.equal(v2, alloc.full_to_swa_index_mapping[small])
    assert (cache.buffer[2:] == 0).all(), "stale live slots left in the padded tail"
    with pytest.raises(CapacityError, match="9 tokens do not fit the graph buffer of 8"):
        cache.refill(torch.ones(9, dtype=torch.int64))


def test_plain_pool_translates_nothing():
    cache = SWALocCache(MHATokenToKVPool(16, 1, torch.float32, 1, 4, 1, "cpu"))
    assert cache.translate(torch.tensor([1])) is None and cache.translations == 0
