"""Review 24: one allocator per SWAKVPool while it holds pages.

A second `SWATokenToKVPoolAllocator` built over a pool whose first allocator holds pages had silently replaced the
pool's translation table: the first allocator's live requests then translated through the second's empty table
(their SWA slots read as 0, the padding). It is refused now (ConfigError, the pool and the first allocator as they
were); a first allocator that holds no pages, or is gone, is replaced as before.
"""
import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.errors import ConfigError
from hwkv.pool import SWAKVPool

P = 4


def pool():
    return SWAKVPool(64, 64, P, torch.float32, 2, 8, [0], [1], "cpu")


def test_a_second_allocator_over_a_pool_whose_first_holds_pages_is_refused():
    kv = pool()
    first = SWATokenToKVPoolAllocator(64, 64, P, "cpu", kv)
    loc = first.alloc(8)
    swa = kv.translate_loc_from_full_to_swa(loc).clone()
    before = first.integrity_snapshot()
    with pytest.raises(ConfigError, match="belongs to another allocator that holds pages"):
        SWATokenToKVPoolAllocator(64, 64, P, "cpu", kv)
    assert kv.full_to_swa_index_mapping is first.full_to_swa_index_mapping
    assert torch.equal(kv.translate_loc_from_full_to_swa(loc), swa) and bool((swa > 0).all())
    assert same_snapshot(before, first.integrity_snapshot())
    first.free(loc)  # once it holds nothing, another may take the pool
    second = SWATokenToKVPoolAllocator(64, 64, P, "cpu", kv)
    assert kv.full_to_swa_index_mapping is second.full_to_swa_index_mapping


def test_an_allocator_that_is_gone_or_empty_is_replaced():
    kv = pool()
    first = SWATokenToKVPoolAllocator(64, 64, P, "cpu", kv)
    first.alloc(8)
    del first  # gone at once: no reference to itself keeps it for the cycle collector
    second = SWATokenToKVPoolAllocator(64, 64, P, "cpu", kv)
    second.alloc(4)
    second.clear()
    third = SWATokenToKVPoolAllocator(64, 64, P, "cpu", kv)
    assert kv.full_to_swa_index_mapping is third.full_to_swa_index_mapping


def test_a_pool_of_the_callers_own_keeps_its_one_argument_hook():
    class Own:
        device = "cpu"
        got = None

        def register_mapping(self, mapping):
            self.got = mapping

    own = Own()
    a = SWATokenToKVPoolAllocator(64, 64, P, "cpu", own)
    assert own.got is a.full_to_swa_index_mapping
