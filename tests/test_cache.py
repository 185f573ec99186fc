"""Prefix caching end to end: a request continued from a matched prefix attends exactly like one
computed from scratch (hwkv.reference), also when the prefix's early SWA pages were evicted and
when the cached request ended inside a page; matching rules and refused operations."""
import pytest
import torch

import hwkv
from hwkv import reference
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.release import release_out_of_window_batch
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.cache import HybridPrefixCache, window_start
from hwkv.errors import CacheError, LocError
from hwkv.pool import SWAKVPool

H, KVH, D = 4, 2, 8


class Engine:
    """A minimal engine over the CPU backend that keeps every token's K/V for the reference."""

    def __init__(self, page, window, size=512, size_swa=96):
        self.page, self.window = page, window
        self.pool = SWAKVPool(size, size_swa, page, torch.float32, KVH, D, [0], [1], "cpu")
        self.alloc = SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", self.pool)
        self.rtt = hwkv.ReqToTokenPool(8, 256, "cpu")
        self.backend = hwkv.make_backend(self.pool, self.rtt, device="cpu", sliding_window=window)
        self.layers = [hwkv.AttentionLayer(0, H, KVH, D, sliding_window=window), hwkv.AttentionLayer(1, H, KVH, D)]
        self.cache = HybridPrefixCache(self.alloc, window)
        self.gen = torch.Generator().manual_seed(0)
        self.kv = {}  # token id sequence prefix -> per-layer (k, v) of that position: same tokens, same K/V

    def kv_of(self, ids, pos, layer):
        key = (tuple(ids[:pos + 1]), layer)
        if key not in self.kv:
            self.kv[key] = (torch.randn(KVH, D, generator=self.gen), torch.randn(KVH, D, generator=self.gen))
        return self.kv[key]

    def start(self, ids):
        match = self.cache.match_prefix(ids[:-1])
        row = self.rtt.alloc(1)[0]
        lock, frontier = self.cache.acquire(match, self.rtt, row)
        return dict(ids=list(ids), row=row, seq=match.length, frontier=frontier, lock=lock, reused=match.length)

    def forward(self, req, n, check=True):
        """Extend (or decode, n == 1) the request by its next n tokens; compare outputs with the reference."""
        s, row = req["seq"], req["row"]
        last = self.rtt.req_to_token[row, s - 1:s] if s else torch.zeros(1, dtype=torch.int64)
        loc = self.alloc.alloc_extend([s], [s + n], last, n)
        self.rtt.write(row, s, loc)
        mode = ForwardMode.DECODE if n == 1 and s else ForwardMode.EXTEND
        batch = ForwardBatch(mode, 1, torch.tensor([row]), torch.tensor([s + n]), loc,
                             extend_prefix_lens=torch.tensor([s]), extend_seq_lens=torch.tensor([n]))
        self.backend.init_forward_metadata(batch)
        worst = 0.0
        for layer in self.layers:
            i = layer.layer_id
            q = torch.randn(n, H, D, generator=self.gen)
            kv = [self.kv_of(req["ids"], p, i) for p in range(s + n)]
            k_all = torch.stack([k for k, _ in kv])
            v_all = torch.stack([v for _, v in kv])
            out = self.backend.forward(q, k_all[s:].clone(), v_all[s:].clone(), layer, batch)
            ref = reference.batch_attention(q, [k_all], [v_all], [s + n], [n], layer.scaling, layer.window,
                                            layer.logit_cap, None)
            worst = max(worst, (out - ref).abs().max().item())
        req["seq"] = s + n
        if check:
            assert worst < 1e-4, f"continued request differs from the reference by {worst}"
        return worst

    def release(self, req):
        f = torch.tensor([req["frontier"]])
        release_out_of_window_batch(self.alloc, self.rtt.req_to_token, torch.tensor([req["row"]]),
                                    torch.tensor([req["seq"]]), f, self.window)
        req["frontier"] = int(f)

    def finish(self, req, cache=True):
        self.cache.release_request(req["ids"], self.rtt, req["row"], req["seq"], req["frontier"], req["lock"],
                                   cache=cache)
        self.rtt.free(req["row"])

    def check(self):
        self.alloc.check_integrity()
        self.cache.check_integrity()


@pytest.mark.parametrize("page, window", [(1, 8), (4, 8), (4, 3), (16, 8)])
def test_continued_requests_match_the_reference(page, window):
    e = Engine(page, window)
    a_ids = list(range(100, 137))                 # 37 tokens: ends inside a page for page > 1
    a = e.start(a_ids + [0])
    assert a["reused"] == 0
    e.forward(a, 37)
    e.cache.insert(a["ids"][:37], e.rtt.req_to_token[a["row"], :37], a["frontier"])  # cached after prefill
    for _ in range(12):                           # decode with release: a's own early SWA pages go
        a["ids"].append(1000 + a["seq"])
        e.forward(a, 1)
        e.release(a)
        e.check()
    assert a["frontier"] > 0

    b = e.start(a_ids + [7, 8, 9, 10, 11])       # shares the prompt; continues from its cached window
    expect = 37 // page * page
    assert b["reused"] == expect and b["frontier"] == window_start(expect, window, page)
    e.forward(b, len(b["ids"]) - b["reused"])
    e.check()
    e.finish(a)
    e.finish(b)
    e.check()

    # a later turn of a: the whole conversation is the prefix; evict the SWA KV the cache can spare first
    e.cache.evict_swa(e.cache.evictable_swa - 0)  # everything unlocked becomes a tombstone ...
    c = e.start(a["ids"] + [5, 6, 7])
    assert c["reused"] == 0                       # ... so nothing is reusable any more
    e.finish(c, cache=False)
    d_ids = a["ids"][:30] + list(range(3000, 3040))
    d = e.start(d_ids)
    e.forward(d, len(d["ids"]) - d["reused"])
    e.cache.insert(d["ids"][:70], e.rtt.req_to_token[d["row"], :70], d["frontier"])
    d2 = e.start(d_ids + [43, 44])                # d's tail window is cached; its first 30 are tombstones
    assert d2["reused"] == 70 // page * page
    e.forward(d2, len(d2["ids"]) - d2["reused"])
    for _ in range(3):
        d2["ids"].append(2000 + d2["seq"])
        e.forward(d2, 1)
        e.release(d2)
    e.check()
    e.finish(d)
    e.finish(d2)
    e.check()
    e.cache.evict(e.cache.evictable_full)
    e.check()
    assert e.alloc.full_available_size() == 512 and e.alloc.swa_available_size() == 96


def test_match_is_cut_back_to_a_cached_window():
    e = Engine(4, 8)
    a = e.start(list(range(40)) + [0])
    e.forward(a, 40)
    e.cache.insert(list(range(40)), e.rtt.req_to_token[a["row"], :40], 24)  # [0, 24) tombstones, SWA after
    assert e.cache.match_prefix(list(range(40))).length == 40     # needs SWA of [32, 40)
    assert e.cache.match_prefix(list(range(37)) + [99]).length == 36  # needs [28, 36)
    assert e.cache.match_prefix(list(range(30)) + [99]).length == 0   # 28 needs [20, 28): tombstones
    assert e.cache.swa_tokens == 16 and e.cache.full_tokens == 40
    assert e.cache.evict_node(e.cache.match_prefix(list(range(8)))) == 0  # no match: the root, a no-op
    b = e.start(list(range(100, 140)) + [0])
    e.forward(b, 40)
    e.cache.insert(list(range(100, 116)), e.rtt.req_to_token[b["row"], :16], 0)   # SWA for [0, 16) ...
    e.cache.insert(list(range(100, 140)), e.rtt.req_to_token[b["row"], :40], 40)  # ... tombstones after
    assert e.cache.match_prefix(list(range(100, 140))).length == 16  # cut back: 16 needs [8, 16) only
    # a's nodes are now [24, 36) and [36, 40) (the match at 36 split it), b's SWA node [0, 16).
    # SWA eviction takes the heads no match at a node's end needs first: [24, 28) and [0, 8) ...
    assert e.cache.evict_swa(12) == 12
    assert e.cache.match_prefix(list(range(40))).length == 40
    assert e.cache.match_prefix(list(range(37)) + [99]).length == 36
    assert e.cache.match_prefix(list(range(100, 140))).length == 16
    # ... then windows by what they serve: b's ends where its conversation went on (a child), a's at a leaf
    assert e.cache.evict_swa(4) >= 4
    assert e.cache.match_prefix(list(range(100, 140))).length == 0
    assert e.cache.match_prefix(list(range(40))).length == 40
    assert e.cache.evict_swa(4) >= 4
    assert e.cache.match_prefix(list(range(40))).length < 40
    assert e.cache.evict_swa(e.cache.evictable_swa) >= 0 and e.cache.swa_tokens == 0
    e.finish(a, cache=False)
    e.finish(b, cache=False)
    e.check()


def test_refused_operations_change_nothing():
    e = Engine(4, 8)
    a = e.start(list(range(20)) + [0])
    e.forward(a, 20)
    e.finish(a)
    e.check()
    before = (e.cache.full_tokens, e.cache.swa_tokens, e.alloc.full_available_size())
    with pytest.raises(CacheError, match="only 20 are unlocked"):
        e.cache.evict(21)
    with pytest.raises(LocError, match="integer"):
        e.cache.match_prefix(torch.tensor([0.5, 1.5]))
    with pytest.raises(LocError, match="swa_start"):
        e.cache.insert(list(range(50, 58)), torch.arange(8, 16), 3)
    with pytest.raises(Exception, match="never allocated|already free"):
        e.cache.insert(list(range(50, 58)), torch.tensor([400] * 8), 0)  # locs that are not live
    b = e.start(list(range(20)) + [5])
    with pytest.raises(CacheError, match="locked"):
        e.cache.evict_node(e.cache.match_prefix(list(range(20))))
    e.cache.unlock(b["lock"])
    with pytest.raises(CacheError, match="already released"):
        e.cache.unlock(b["lock"])
    assert (e.cache.full_tokens, e.cache.swa_tokens, e.alloc.full_available_size()) == before
    e.check()
