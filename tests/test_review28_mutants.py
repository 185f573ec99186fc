"""Review 28 (test-suite audit by mutation): single-line mutants of hwkv/allocator.py, hwkv/metadata.py, hwkv/pool.py
and hwkv/graph.py that the rest of the suite let through, each pinned here by a small deterministic CPU test that
passes on the code as it is and fails with the mutant applied (each test's docstring names its mutant as
`module:line  original -> mutant`).
"""
import pytest
import torch

from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, same_snapshot
from hwkv.errors import CapacityError, ConfigError, LocError, OutOfSlotsError, ShapeError

pytestmark = pytest.mark.usefixtures("one_thread")

I64 = torch.int64


def _paged(size=64, page=4):
    return PagedTokenToKVPoolAllocator(size, page, "cpu")


def _hybrid(size=64, size_swa=32, page=4):
    return SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", None)


# ------------------------------------------------------------------------------------------- hwkv/allocator.py
def test_alloc_extend_refuses_a_last_loc_per_request_count_that_differs_and_changes_nothing():
    """allocator.py:128 `if not prefix.size == seq.size == n_last:` -> `if not prefix.size == seq.size:`. Two
    last_locs for one request were taken (the extra one ignored) and the request got its slots, no error."""
    a = _paged()
    snap = a.integrity_snapshot()
    with pytest.raises(LocError, match="one entry per request"):
        a.alloc_extend([0], [3], [0, 0], 3)
    assert same_snapshot(snap, a.integrity_snapshot())


def test_alloc_extend_refuses_a_seq_len_one_below_its_prefix():
    """allocator.py:132 `int(ext.min()) < 0` -> `< -1`. A request whose seq_len is one short of its prefix_len (an
    extend of -1 tokens) beside one of +1 passed the token count (0 = -1 + 1) and was planned as a valid batch."""
    a = _paged()
    snap = a.integrity_snapshot()
    with pytest.raises(LocError, match="seq_len 2 is shorter than prefix_len 3"):
        a.alloc_extend([3, 0], [2, 1], [0, 0], 0)
    assert same_snapshot(snap, a.integrity_snapshot())


def test_alloc_extend_refuses_a_negative_prefix_len():
    """allocator.py:135 `if ext.size and int(prefix.min()) < 0:` -> `if False:`. prefix -1, seq 1 (two tokens, a
    count that matches) was planned with positions -1 and 0."""
    a = _paged()
    snap = a.integrity_snapshot()
    with pytest.raises(LocError, match="prefix_lens must be >= 0"):
        a.alloc_extend([-1], [1], [0], 2)
    assert same_snapshot(snap, a.integrity_snapshot())


def test_alloc_decode_refuses_a_zero_length_at_page_size_above_one():
    """allocator.py:147 `int(seq.min()) < 1` -> `< 0`. A decode of seq_len 0 (token -1) with a last_loc at in-page
    offset 2 passed the continuation check (its offset arithmetic wraps) and got last_loc + 1."""
    a = _paged()
    s = a.alloc_extend([0], [3], [0], 3)  # slots 4, 5, 6 (page 1)
    with pytest.raises(LocError, match="decode seq_lens must be >= 1"):
        a.alloc_decode([0], [int(s[-1])])


def test_paged_allocator_refuses_a_size_that_is_not_whole_pages():
    """allocator.py:158 drops `or size % page_size`. size 10 at page 4 was taken: two pages and two slots that no
    page covers (the pool it fits is [size + page_size] rows: a size-10 pool would miss slots 12-13)."""
    with pytest.raises(ConfigError, match="multiple of page_size"):
        PagedTokenToKVPoolAllocator(10, 4, "cpu")


@pytest.mark.parametrize("page", [1, 4])
def test_alloc_decode_refuses_last_locs_of_another_count(page):
    """allocator.py:282 `if n_last != bs:` -> `if False:`. Two requests and one last_loc went on to the allocation
    (a numpy shape error, or one request's slot from the other's last_loc), not the LocError naming both counts."""
    a = _paged(page=page)
    snap = a.integrity_snapshot()
    with pytest.raises(LocError, match=r"seq_lens \(2\) and last_loc \(1\)"):
        a.alloc_decode(torch.tensor([1, 1]), torch.tensor([0]))
    assert same_snapshot(snap, a.integrity_snapshot())


def test_alloc_decode_slots_are_int64_whatever_the_last_loc_dtype():
    """allocator.py:296 `if seq_dev.dtype != I64 or last_dev.dtype != I64:` -> `and`. int64 lengths and int32
    last_locs: a decode continuing its page returned last_loc + 1 as int32 (the pools' write locs are int64)."""
    a = _paged()
    s = a.alloc_extend([0], [3], [0], 3)
    out = a.alloc_decode(torch.tensor([4]), torch.tensor([int(s[-1])], dtype=torch.int32))
    assert out.dtype == I64 and out.tolist() == [int(s[-1]) + 1]


def test_reserve_refuses_a_negative_page_count_and_changes_nothing():
    """allocator.py:387 `if pages < 0:` -> `if False:`. reserve(-1) moved every ring's head back by one page (a page
    already handed out would be handed out again) and numbered an op."""
    a = _hybrid()
    snap, op = a.integrity_snapshot(), a.op_number
    with pytest.raises(ConfigError, match="needs an integer >= 0"):
        a.reserve(-1)
    assert same_snapshot(snap, a.integrity_snapshot()) and a.op_number == op
    assert a.available_size() == 32


def test_reserve_refuses_more_pages_than_are_free_and_changes_nothing():
    """allocator.py:391-392 the room check dropped. reserve(9) of an SWA pool of 8 pages claimed them all and more:
    the ring heads ran past the tails (the pages claimed past the free ones are live pages)."""
    a = _hybrid()
    snap = a.integrity_snapshot()
    with pytest.raises(OutOfSlotsError, match="need 9 pages"):
        a.reserve(9)
    assert same_snapshot(snap, a.integrity_snapshot())
    assert a.available_size() == 32


def test_continuation_of_a_last_loc_one_past_the_pool_is_refused():
    """allocator.py:482 `last_h >= self.size + p` -> `>`. A last_loc of size + P (the first slot past the pool, at an
    in-page offset that fits prefix 1) clipped onto the last page, which is live, and the request got slot size+P+1,
    past every K/V buffer."""
    a = _paged(size=16)
    a.alloc(16)  # every page live
    snap = a.integrity_snapshot()
    with pytest.raises(LocError, match="outside the full pool's slots"):
        a.alloc_extend([1], [2], [20], 1)
    assert same_snapshot(snap, a.integrity_snapshot())


def test_hybrid_allocator_names_size_swa_when_it_is_not_whole_pages():
    """allocator.py:738 drops `or size_swa % page_size`. The SWA half's own constructor then refused `size=30`, a
    parameter the caller did not pass under that name."""
    with pytest.raises(ConfigError, match="size_swa=30 must be"):
        SWATokenToKVPoolAllocator(64, 30, 4, "cpu", None)


def test_hybrid_available_size_is_the_smaller_pool():
    """allocator.py:782 `min(full, swa)` -> `max`. An allocation needs a slot in both pools: 64 full and 32 SWA slots
    leave room for 32 tokens, not 64."""
    a = _hybrid()
    assert a.available_size() == 32
    a.alloc(8)
    assert (a.available_size(), a.full_available_size(), a.swa_available_size()) == (24, 56, 24)


def test_clear_keeps_the_trailing_minus_one_of_the_table():
    """allocator.py:786 `mapping[:-1].zero_()` -> `mapping.zero_()`. After clear() the table's trailing entry (the
    translation of loc -1, "no loc") read 0, the padding slot, and check_integrity failed."""
    a = _hybrid()
    a.alloc(8)
    a.clear()
    assert a.translate_loc_from_full_to_swa(torch.tensor([-1, 0])).tolist() == [-1, 0]
    a.check_integrity()
    assert a.available_size() == 32


def test_alloc_decode_takes_column_lengths_as_flat_ones():
    """allocator.py:63 drops `x.dim() == 1 and` from the host fast path. [bs, 1] int64 lengths came back 2-D from
    the host copy and the decode plan's mask indexed the 1-D slots with it (IndexError); flattened, they are one
    length per request, as the device path reads them."""
    a = _paged()
    a.alloc_extend([0, 0], [4, 2], [0, 0], 6)  # request 0: slots 4-7 (page full), request 1: 8, 9
    out = a.alloc_decode(torch.tensor([[5], [3]]), torch.tensor([7, 9]))
    assert out.tolist() == [12, 10]


def test_free_refuses_int32_locs_and_changes_nothing():
    """allocator.py:111 drops `or loc.dtype != I64`. An int32 loc tensor was freed (the allocator's locs are int64
    everywhere; the device ops index with them)."""
    a = _hybrid()
    loc = a.alloc(4)
    snap = a.integrity_snapshot()
    with pytest.raises(LocError, match="int64 tensor"):
        a.free(loc.to(torch.int32))
    assert same_snapshot(snap, a.integrity_snapshot())


def test_has_room_needs_room_in_every_ring():
    """allocator.py:231 `all(...)` -> `any(...)`. 9 pages fit the full ring (16 free) but not the SWA ring (8): the
    hybrid allocator said they fit."""
    a = _hybrid()
    assert a.has_room(8) and not a.has_room(9)


def test_alloc_of_two_to_the_63_is_a_config_error():
    """allocator.py:244 `n >= 2 ** 63` -> `n > 2 ** 63`. alloc(2**63) went on to the host copy of the lengths and
    failed there with numpy's OverflowError instead of the ConfigError naming the bound."""
    a = PagedTokenToKVPoolAllocator(8, 1, "cpu")
    with pytest.raises(ConfigError, match="below 2\\*\\*63"):
        a.alloc(2 ** 63)


def test_page_size_one_decode_of_device_lengths_takes_fresh_slots():
    """allocator.py:335 `pre_h = seq_h - 1 if prefix is None` -> `seq_h`. At page size 1 a decode with tensor lengths
    and no host copy is planned without reading them and allocated on the host as an extend of [seq - 1, seq): with
    the mutant each request extended zero tokens and the slots' arithmetic failed (numpy broadcast error)."""
    a = PagedTokenToKVPoolAllocator(16, 1, "cpu")
    assert a.alloc_extend([0, 0], [3, 2], [0, 0], 5).tolist() == [1, 2, 3, 4, 5]
    assert a.alloc_decode(torch.tensor([4, 3]), torch.tensor([3, 5])).tolist() == [6, 7]
    assert a.available_size() == 9


# -------------------------------------------------------------------------------------------- hwkv/metadata.py
def test_layer_outputs_fill_the_bound_exactly():
    """metadata.py:44 `> self.MAX_BYTES` -> `>=`. Outputs whose sum is exactly MAX_BYTES fit the one allocation (the
    bound is what may be kept alive); the mutant allocated every layer alone."""
    from hwkv.metadata import LayerOutputs
    outs = LayerOutputs(4)
    q = torch.zeros(1, 1, 1)
    t = LayerOutputs.MAX_BYTES // 4 // 4  # 4 fp32 outputs of t rows: exactly the bound
    a, b = outs.take(0, q, t, 1, 1), outs.take(1, q, t, 1, 1)
    assert outs.key is not None
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() != b.data_ptr()


def test_a_layer_taking_its_output_twice_gets_a_tensor_of_its_own():
    """metadata.py:49 drops `layer_id in self.taken or`. A layer called twice before the others got its first view
    again: the second call's output overwrote the first, which the caller still held."""
    from hwkv.metadata import LayerOutputs
    outs = LayerOutputs(3)
    q = torch.zeros(2, 4, 8)
    a = outs.take(0, q, 2, 4, 8)
    again = outs.take(0, q, 2, 4, 8)
    assert again.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    b = outs.take(1, q, 2, 4, 8)  # the next layer still gets the next view of the one allocation
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and b.data_ptr() != a.data_ptr()


def test_layer_outputs_past_the_planned_layers_are_allocated_alone():
    """metadata.py:49 `len(self.taken) >= self.slots` -> `>`. A third distinct layer of a forward planned for two
    took view 2 of a tuple of two (IndexError)."""
    from hwkv.metadata import LayerOutputs
    outs = LayerOutputs(2)
    q = torch.zeros(2, 4, 8)
    a, b = outs.take(0, q, 2, 4, 8), outs.take(1, q, 2, 4, 8)
    c = outs.take(2, q, 2, 4, 8)
    assert c.shape == (2, 4, 8)
    assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _Layer:
    def __init__(self, layer_id, window):
        self.layer_id, self.window = layer_id, window


def _metadata(windows):
    from hwkv.loc import KVWriteLoc
    from hwkv.metadata import ForwardMetadata, KVIndexList

    def lst(w, swa):
        return KVIndexList(torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=I64), torch.zeros(1, dtype=I64),
                           w, 4, is_swa_slots=swa)
    z = torch.zeros(1, dtype=I64)
    return ForwardMetadata(KVWriteLoc(z), None, torch.zeros(2, dtype=torch.int32), z, lst(None, False),
                           {w: lst(w, swa) for w, swa in windows.items()}, 1, 1, True)


def test_list_for_refuses_a_windowless_layer_of_the_swa_pool():
    """metadata.py:84 `if swa_group: raise` -> `if False:`. An SWA-pool layer without a window got the full list:
    full-pool locs read as SWA slots."""
    md = _metadata({8: True})
    with pytest.raises(ConfigError, match="sits in the SWA pool but has no sliding_window"):
        md.list_for(_Layer(3, None), True)
    assert md.list_for(_Layer(0, None), False) is md.full


def test_list_for_gives_a_full_pool_windowed_layer_its_window_list_of_full_locs():
    """metadata.py:88 drops `lst.is_swa_slots and`. Over a pool without SWA slots (window lists of full-pool locs) a
    windowed layer got the whole full list instead of its window's: correct under the kernel's mask, but every key
    of the context read where W keys are visible."""
    md = _metadata({8: False})
    assert md.list_for(_Layer(1, 8), False) is md.windows[8]
    md = _metadata({8: True})  # a hybrid pool's window list holds SWA slots: a full-pool layer reads the full list
    assert md.list_for(_Layer(1, 8), False) is md.full and md.list_for(_Layer(2, 8), True) is md.windows[8]


def test_list_for_refuses_an_swa_layer_of_a_window_the_backend_has_no_list_for():
    """metadata.py:91 `if swa_group: raise` -> `if False:`. An SWA-pool layer of window 16 over a backend built for
    8 got the full list (full-pool locs read as SWA slots) instead of the ConfigError naming the windows."""
    md = _metadata({8: True})
    with pytest.raises(ConfigError, match=r"sliding_window=16 but the backend was built for windows \[8\]"):
        md.list_for(_Layer(5, 16), True)
    assert md.list_for(_Layer(5, 16), False) is md.full


def test_graph_window_rows_start_on_16_byte_boundaries():
    """metadata.py:146 `aligned_width(max(win_cap), int64)` -> `max(win_cap)`. Windows 3 and 5 at one request and one
    token: rows of 5 int64 put window 5's list at byte 40 of the buffer, so its alignment (and the Triton variant
    compiled for it) followed the bucket's sizes."""
    from hwkv.metadata import alloc_static
    s = alloc_static(1, 1, 100, [3, 5], torch.device("cpu"))
    assert [s.win_indices[w].numel() for w in (3, 5)] == [3, 5]
    assert all(s.win_indices[w].data_ptr() % 16 == 0 for w in (3, 5))
    assert s.win_rows.shape == (2, 6)


def test_kept_range_grows_to_a_request_past_twice_its_size():
    """metadata.py:183 `max(n, 2 * t.shape[0])` -> `2 * t.shape[0]`. A request for 20 entries of a range kept at 4
    came back with 8 (arange(8)): a decode qo_indptr shorter than the batch."""
    from hwkv.metadata import KeptRange
    r = KeptRange(I64, torch.device("cpu"), start=4)
    assert r(20).tolist() == list(range(20))
    z = KeptRange(torch.int32, torch.device("cpu"), start=2, zeros=True)
    assert z(9).tolist() == [0] * 9


# ------------------------------------------------------------------------------------------------ hwkv/pool.py
def test_an_e4m3fn_pool_refuses_e4m3fnuz_kv():
    """pool.py:26 drops `and b.smallest_normal <= a.smallest_normal`. e4m3fnuz's normals reach 2**-7, e4m3fn's stop
    at 2**-6 (its eps and max are no worse): fnuz K/V into an e4m3fn pool is a lossy cast the pool refuses."""
    from hwkv.pool import MHATokenToKVPool, writable_dtypes
    assert torch.float8_e4m3fnuz not in writable_dtypes(torch.float8_e4m3fn)
    pool = MHATokenToKVPool(16, 4, torch.float8_e4m3fn, 1, 4, 1, "cpu")
    k = torch.full((1, 1, 4), 2.0 ** -7).to(torch.float8_e4m3fnuz)
    with pytest.raises(ShapeError, match="cache_k is torch.float8_e4m3fnuz"):
        pool.set_kv_buffer(_Layer(0, None), torch.tensor([4]), k, k)
    assert pool.get_key_buffer(0).float().abs().sum() == 0


def test_translate_into_a_buffer_right_after_the_locs_is_no_overlap():
    """pool.py:89 `a0 < b1 and b0 < a1` -> `<=`, and pool.py:86 `(n - 1) * s` -> `n * s` (a span one element
    long). Locs in [0, 32) bytes of a buffer and out= at [32, 64): spans that touch but share no byte were refused as
    overlapping (LocError)."""
    from hwkv.pool import SWAKVPool
    pool = SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(16, 8, 1, "cpu", pool)
    loc = a.alloc(4)
    buf = torch.zeros(8, dtype=I64)
    buf[:4] = loc
    got = pool.translate_loc_from_full_to_swa(buf[:4], out=buf[4:])
    assert got.tolist() == a.translate_loc_from_full_to_swa(loc).tolist() and buf[4:].tolist() == got.tolist()


def test_a_group_pool_refuses_a_size_that_is_not_whole_pages():
    """pool.py:116 `if size % page_size:` -> `if False:`. MHATokenToKVPool(10, page_size=4) was built: its buffers
    of size + page_size rows had no room for the pages an allocator of 12 slots hands out."""
    from hwkv.pool import MHATokenToKVPool
    with pytest.raises(ConfigError, match="size=10 must be a multiple of page_size=4"):
        MHATokenToKVPool(10, 4, torch.float32, 1, 4, 1, "cpu")


def test_an_e4m3fnuz_pool_refuses_e4m3fn_kv():
    """pool.py:26 drops `b.max >= a.max and`. e4m3fn reaches 448, e4m3fnuz only 240 (same eps, finer normals): fn K/V
    into an fnuz pool is a lossy cast (448 has no fnuz value) the pool refuses."""
    from hwkv.pool import MHATokenToKVPool, writable_dtypes
    assert torch.float8_e4m3fn not in writable_dtypes(torch.float8_e4m3fnuz)
    pool = MHATokenToKVPool(16, 4, torch.float8_e4m3fnuz, 1, 4, 1, "cpu")
    k = torch.full((1, 1, 4), 448.0).to(torch.float8_e4m3fn)
    with pytest.raises(ShapeError, match="cache_k is torch.float8_e4m3fn,"):
        pool.set_kv_buffer(_Layer(0, None), torch.tensor([4]), k, k)


def test_a_pool_that_needs_exactly_the_free_memory_fits(monkeypatch):
    """pool.py:72 `nbytes > free` -> `>=`. A pool of exactly the bytes the device has free was refused."""
    import hwkv.pool as pool_mod
    need = pool_mod._group_bytes(16, 4, torch.float32, 1, 4, 4, 2)
    monkeypatch.setattr(pool_mod, "device_free_bytes", lambda device: need)
    pool = pool_mod.MHATokenToKVPool(16, 4, torch.float32, 1, 4, 2, "cpu")
    assert sum(b.numel() * b.element_size() for b in pool.k_buffer + pool.v_buffer) == need
    monkeypatch.setattr(pool_mod, "device_free_bytes", lambda device: need - 1)
    with pytest.raises(ConfigError, match=f"needs {need} bytes"):
        pool_mod.MHATokenToKVPool(16, 4, torch.float32, 1, 4, 2, "cpu")


def test_swa_pool_refuses_a_0d_tensor_of_layer_ids():
    """pool.py:246 drops `or (isinstance(ids, torch.Tensor) and ids.dim() == 0)`. A 0-d tensor has __iter__ but
    iterating it raises a bare TypeError, not the ConfigError naming the argument."""
    from hwkv.pool import SWAKVPool
    with pytest.raises(ConfigError, match="swa_attention_layer_ids=tensor\\(0\\) must be a sequence"):
        SWAKVPool(16, 8, 1, torch.float32, 1, 4, torch.tensor(0), [1], "cpu")


def test_swa_pool_refuses_a_bool_head_count():
    """pool.py:276 drops `or isinstance(val, bool)`. swa_head_num=True passed as a head count of 1."""
    from hwkv.pool import SWAKVPool
    with pytest.raises(ConfigError, match="swa_head_num=True must be an int >= 1"):
        SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0], [1], "cpu", swa_head_num=True)


def test_translate_refuses_an_out_one_entry_short():
    """pool.py:369 `if cap < n:` -> `if cap < n - 1:`. Four locs and out= of three went on to the gather (an error of
    the op, or a translation cut short), not the CapacityError naming both sizes."""
    from hwkv.pool import SWAKVPool
    pool = SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(16, 8, 1, "cpu", pool)
    loc = a.alloc(4)
    out = torch.full((3,), 7, dtype=I64)
    with pytest.raises(CapacityError, match="4 locs do not fit out= of 3 entries"):
        pool.translate_loc_from_full_to_swa(loc, out=out)
    assert out.tolist() == [7, 7, 7]


def test_a_group_pool_refuses_the_layer_id_one_past_its_last():
    """pool.py:141 `0 <= layer_id < self.layer_num` -> `<=`. Layer id == layer_num passed the check and failed at the
    buffer list with a bare IndexError."""
    from hwkv.pool import MHATokenToKVPool
    pool = MHATokenToKVPool(16, 4, torch.float32, 1, 4, 2, "cpu")
    assert pool.get_key_buffer(1) is pool.k_buffer[1]
    with pytest.raises(ConfigError, match=r"layer_id 2 out of range \[0, 2\)"):
        pool.get_key_buffer(2)
    with pytest.raises(ConfigError, match=r"layer_id 2 out of range"):
        pool.set_kv_buffer(_Layer(2, None), torch.tensor([4]), torch.ones(1, 1, 4), torch.ones(1, 1, 4))


def test_set_kv_buffer_refuses_a_v_of_the_wrong_head_dim_writing_nothing():
    """pool.py:188 drops the `cache_v.shape` compare. A V of head dim 5 (the pool's is 4) with a good K went to the
    store, which failed past the host checks (the refusal is to come first, with K unwritten and a ShapeError)."""
    from hwkv.pool import MHATokenToKVPool
    pool = MHATokenToKVPool(16, 4, torch.float32, 1, 4, 1, "cpu")
    with pytest.raises(ShapeError, match=r"cache_v has shape \[1, 1, 5\], expected \[1, 1, 4\]"):
        pool.set_kv_buffer(_Layer(0, None), torch.tensor([4]), torch.ones(1, 1, 4), torch.ones(1, 1, 5))
    assert pool.get_key_buffer(0).abs().sum() == 0 and pool.get_value_buffer(0).abs().sum() == 0


def test_swa_pool_refuses_a_layer_id_repeated_within_the_swa_group():
    """pool.py:270 drops `len(set(swa_ids)) != len(swa_ids) or`. SWA ids [0, 0] built a pool of two SWA layers whose
    mapping had one: layer 0's buffers were those of local layer 1, local layer 0 never used."""
    from hwkv.pool import SWAKVPool
    with pytest.raises(ConfigError, match="layer ids must be unique"):
        SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0, 0], [1], "cpu")


def test_the_allocator_that_owns_the_table_may_register_it_again_while_holding_pages():
    """pool.py:326 drops `held is not owner and`. Only another allocator is refused while the first holds pages; the
    owner registering its own table again (a rebuild of the same pairing) was refused as if it were another."""
    from hwkv.pool import SWAKVPool
    pool = SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(16, 8, 1, "cpu", pool)
    a.alloc(2)
    pool.register_mapping(a.full_to_swa_index_mapping, a)
    assert pool.full_to_swa_index_mapping is a.full_to_swa_index_mapping
    with pytest.raises(ConfigError, match="belongs to another allocator that holds pages"):
        SWATokenToKVPoolAllocator(16, 8, 1, "cpu", pool)


def test_translate_refuses_lists_with_loc_runs():
    """pool.py:348 `(out is None or isinstance(loc, LocRuns))` -> `out is None`. lists= beside LocRuns went down the
    runs' path and the lists were silently not built (the caller's graph refill would read stale lists)."""
    from hwkv.loc import LocRuns
    from hwkv.pool import SWAKVPool
    pool = SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0], [1], "cpu")
    SWATokenToKVPoolAllocator(16, 8, 1, "cpu", pool)
    runs = LocRuns(torch.zeros(2, 4, dtype=I64), torch.tensor([0]), torch.tensor([0]),
                   torch.tensor([0, 2], dtype=torch.int32))
    out = torch.full((4,), 7, dtype=I64)
    with pytest.raises(ConfigError, match="lists= needs the write locs as a tensor and out="):
        pool.translate_loc_from_full_to_swa(runs, out=out, lists=object())
    assert out.tolist() == [7] * 4


def test_swa_layer_with_a_swa_loc_keyword_of_another_length_is_trimmed_or_refused():
    """pool.py:428 `if swa_loc.shape[0] != loc.shape[0]:` -> `if False:`. A swa_loc= longer than loc (a static
    buffer) reached the SWA group untrimmed and the write was refused for K of 2 rows against 4 locs; one shorter
    got that ShapeError too instead of KVWriteLoc's LocError."""
    from hwkv.pool import SWAKVPool
    pool = SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0], [1], "cpu")
    k = torch.ones(2, 1, 4)
    pool.set_kv_buffer(_Layer(0, 8), torch.tensor([3, 4]), k, 2 * k, swa_loc=torch.tensor([5, 6, 0, 0]))
    assert pool.get_key_buffer(0)[[5, 6]].eq(1).all() and pool.get_value_buffer(0)[[5, 6]].eq(2).all()
    assert pool.get_key_buffer(0).sum() == 8  # rows 5 and 6 only
    with pytest.raises(LocError, match="shorter"):
        pool.set_kv_buffer(_Layer(0, 8), torch.tensor([3, 4]), k, k, swa_loc=torch.tensor([5]))


# ----------------------------------------------------------------------------------------------- hwkv/graph.py
def _graph_harness(buckets, backend=None):
    from hwkv.batch import ForwardMode
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv.testing.reference_backend import ReferenceBackend
    h = Harness(backend or ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    runner = h.enable_graphs(list(buckets))
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [5, 9, 7], ForwardMode.EXTEND)
    h.release()
    return h, runner, rids


def test_graph_runner_refuses_a_bucket_of_zero_requests():
    """graph.py:75 `min(batch_sizes) < 1` -> `< 0`. A bucket of 0 was captured (a graph of no requests) beside the
    others instead of the ConfigError naming the sizes."""
    from hwkv.graph import GraphRunner
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv.testing.reference_backend import ReferenceBackend
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    with pytest.raises(ConfigError,
                       match=r"batch_sizes must be integers >= 1 \(a list, tuple or set, non-empty\), got \[0, 2\]"):
        GraphRunner(h.backend, h.model_step, [0, 2], h._input_shapes())


def test_unsorted_buckets_still_pick_the_smallest_that_fits():
    """graph.py:82 `sorted(set(batch_sizes))` -> the sizes in the caller's order (deduplicated). Buckets [4, 1, 2]:
    the largest was taken to be 2 (static buffers for 2 requests) and bisect over the unsorted list ran a batch of 3
    eagerly instead of replaying bucket 4."""
    from hwkv.batch import ForwardMode
    h, runner, rids = _graph_harness([4, 1, 2])
    assert runner.buckets == [1, 2, 4]
    batch, inputs = h.prepare(rids, [1, 1, 1], ForwardMode.DECODE)
    step = runner.prepare(batch, inputs)
    assert step.bucket == 4
    flat = runner.replay(step)
    assert runner.replays == 1 and runner.eager_runs == 0
    h.complete(rids, [1, 1, 1], inputs, flat)  # checked against the reference


def test_a_batch_without_host_lengths_is_refilled_without_stale_ones():
    """graph.py:131 `key = (bs, self._host_lens)` -> `(bs, True)`. After a batch with host lengths, one without them
    was refilled through the static batch that carries host copies: the previous step's lengths, one token short of
    the device's (a backend that plans from host lengths would size its lists from them)."""
    import dataclasses
    from hwkv.batch import ForwardMode
    from hwkv.testing.reference_backend import ReferenceBackend
    seen = []

    class Spy(ReferenceBackend):
        def init_forward_metadata_graph(self, batch, max_q_len=None):
            host = None if batch.seq_lens_cpu is None else batch.seq_lens_cpu.tolist()
            seen.append((batch.seq_lens.tolist(), host))
            return super().init_forward_metadata_graph(batch, max_q_len)

    h, runner, rids = _graph_harness([4], Spy)
    for host in (True, False):
        batch, inputs = h.prepare(rids, [1, 1, 1], ForwardMode.DECODE)
        if not host:
            batch = dataclasses.replace(batch, seq_lens_cpu=None)
        seen.clear()
        flat = runner.run(batch, inputs)
        h.complete(rids, [1, 1, 1], inputs, flat)
        (dev, hst), = seen
        assert hst is None or hst == dev, f"the refill's host lengths {hst} are not its lengths {dev}"
        assert (hst is not None) == host


def test_debug_graph_verify_refuses_ragged_draft_counts_without_host_copies():
    """graph.py:167 the debug read of `extend_seq_lens` dropped. Without host copies a linear verify of draft counts
    [1, 3] (4 tokens over 2 requests of 2) was copied into the static batch and run as [2, 2]: the wrong tokens'
    queries and positions, no error."""
    import dataclasses
    from test_spec_refusals import VERIFY, assert_unchanged, harness, snapshot
    h, rids = harness()
    runner = h.enable_graphs([2], mode=VERIFY, tokens_per_req=2)
    h.backend.debug = True
    batch, inputs = h.prepare(rids, [1, 3], VERIFY)
    bad = dataclasses.replace(batch, extend_seq_lens_cpu=None, seq_lens_cpu=None)
    before = snapshot(h, runner)
    with pytest.raises(ShapeError, match=r"graph mode needs 2 new token\(s\) per request; extend_seq_lens are "
                                         r"\[1, 3\]"):
        runner.prepare(bad, inputs)
    assert_unchanged(h, before, runner)


def test_translate_refuses_an_out_that_overlaps_the_locs():
    """pool.py:365 the overlap check dropped (`if False:`). out= two entries into the locs' own buffer: the gather
    read locs it had already overwritten with SWA slots, no error."""
    from hwkv.pool import SWAKVPool
    pool = SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(16, 8, 1, "cpu", pool)
    buf = torch.zeros(6, dtype=I64)
    buf[:4] = a.alloc(4)
    before = buf.clone()
    with pytest.raises(LocError, match="out= overlaps loc"):
        pool.translate_loc_from_full_to_swa(buf[:4], out=buf[2:6])
    assert torch.equal(buf, before)


def test_swa_layer_takes_the_swa_loc_keyword_beside_a_write_loc_without_one():
    """pool.py:407 `loc.swa_loc if swa_loc is None else swa_loc` -> `loc.swa_loc`. A KVWriteLoc of full locs only with
    the SWA slots passed as swa_loc= lost them (MissingSWALocError); one carrying other SWA slots overrode the
    keyword."""
    from hwkv.loc import KVWriteLoc
    from hwkv.pool import SWAKVPool
    pool = SWAKVPool(16, 8, 1, torch.float32, 1, 4, [0], [1], "cpu")
    k = torch.ones(2, 1, 4)
    pool.set_kv_buffer(_Layer(0, 8), KVWriteLoc(torch.tensor([3, 4])), k, k, swa_loc=torch.tensor([5, 6]))
    pool.set_kv_buffer(_Layer(0, 8), KVWriteLoc(torch.tensor([3, 4]), torch.tensor([1, 2])), 2 * k, 2 * k,
                       swa_loc=torch.tensor([7, 8]))
    got = pool.get_key_buffer(0)[:, 0, 0].tolist()
    assert got == [0, 0, 0, 0, 0, 1, 1, 2, 2]


def test_padded_requests_read_row_0_after_a_larger_batch():
    """graph.py:238 the padding's `req_pool_indices[live:bs_pad].zero_()` dropped. A batch of 3 in bucket 4 after a
    batch of 4 left the padded request on the fourth request's row (a live request's row, or a finished one's stale
    locs), not the padding row 0 the graph's padded requests read."""
    from hwkv.batch import ForwardMode
    h, runner, rids = _graph_harness([4])
    rids.append(h.add_request())
    h.forward(rids[3:], [6], ForwardMode.EXTEND)
    for live in (rids, rids[:3]):
        batch, inputs = h.prepare(live, [1] * len(live), ForwardMode.DECODE)
        flat = runner.run(batch, inputs)
        h.complete(live, [1] * len(live), inputs, flat)
    assert runner.req_pool_indices[3].item() == 0 and runner.seq_lens[3].item() == 1
    assert runner.out_cache_loc[3].item() == 0


def test_padded_requests_host_lengths_are_their_lengths_after_a_larger_batch():
    """graph.py:242 the padding's `seq_lens_cpu[live:bs_pad].fill_(self.tpr)` dropped. After a batch of 4, a batch of
    3 in bucket 4 was refilled with the padded request's host length left at the fourth request's (its device
    length is 1): host and device lengths of one batch disagreed."""
    from hwkv.batch import ForwardMode
    from hwkv.testing.reference_backend import ReferenceBackend
    seen = []

    class Spy(ReferenceBackend):
        def init_forward_metadata_graph(self, batch, max_q_len=None):
            seen.append((batch.seq_lens.tolist(), None if batch.seq_lens_cpu is None else batch.seq_lens_cpu.tolist()))
            return super().init_forward_metadata_graph(batch, max_q_len)

    h, runner, rids = _graph_harness([4], Spy)
    rids.append(h.add_request())
    h.forward(rids[3:], [6], ForwardMode.EXTEND)
    for live in (rids, rids[:3]):
        batch, inputs = h.prepare(live, [1] * len(live), ForwardMode.DECODE)
        seen.clear()
        flat = runner.run(batch, inputs)
        h.complete(live, [1] * len(live), inputs, flat)
        (dev, hst), = seen
        assert hst == dev and len(dev) == 4


def test_decode_graphs_refuse_more_than_one_token_per_request():
    """graph.py:79 `if mode == DECODE and tokens_per_req != 1:` -> `if False:`. A DECODE runner of 2 tokens per
    request was built (static buffers for 2 tokens a request that no decode batch has)."""
    from hwkv.batch import ForwardMode
    from hwkv.graph import GraphRunner
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv.testing.reference_backend import ReferenceBackend
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    with pytest.raises(ConfigError, match="DECODE graphs run one token per request, not tokens_per_req=2"):
        GraphRunner(h.backend, h.model_step, [2], h._input_shapes(), mode=ForwardMode.DECODE, tokens_per_req=2)


def test_graph_verify_refuses_a_token_count_of_another_size_without_host_copies():
    """graph.py:261 the `batch.num_tokens != bs * self.tpr` check dropped. A verify of draft counts [2, 3] without
    host copies (so no per-request check) copied the inputs into the static buffers and then failed copying 5 write
    locs into 4 (a RuntimeError, the static batch half written), not the ShapeError before any change."""
    import dataclasses
    from test_spec_refusals import VERIFY, assert_unchanged, harness, snapshot
    h, rids = harness()
    runner = h.enable_graphs([2], mode=VERIFY, tokens_per_req=2)
    batch, inputs = h.prepare(rids, [2, 3], VERIFY)
    bad = dataclasses.replace(batch, extend_seq_lens_cpu=None, seq_lens_cpu=None)
    before = snapshot(h, runner)
    inputs_before = {k: v.clone() for k, v in runner.inputs.items()}
    with pytest.raises(ShapeError, match=r"graph mode needs 2 token\(s\) per request: 5 tokens for 2 requests"):
        runner.prepare(bad, inputs)
    assert_unchanged(h, before, runner)
    assert all(torch.equal(runner.inputs[k], v) for k, v in inputs_before.items())


def _tree_graph_harness():
    from hwkv.batch import ForwardMode
    from hwkv.graph import EagerAdapter
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv_cpu.backend import TorchCPUBackend
    geom = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(TorchCPUBackend, "cpu", geom, size=256, size_swa=64)
    runner = h.enable_graphs([2], EagerAdapter(), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=5, tree=True)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 3], ForwardMode.EXTEND)
    return h, runner, rids


def test_a_plain_verify_after_a_tree_verify_runs_causal_in_a_tree_graph():
    """graph.py:300 the chain copy of a verify without a tree dropped (`pass`). A plain (chain) verify replayed after
    a tree verify attended through the tree's static mask (siblings that cannot see each other), not causally:
    its outputs were not the reference's."""
    from hwkv.batch import ForwardMode
    from hwkv.testing.spec_harness import tree_verify
    h, runner, rids = _tree_graph_harness()
    tree_verify(h, rids, [[-1, 0, 0, 0, 0], [-1, -1, -1, -1, -1]], [[0, 1], [0]])  # checked against the reference
    h.release()
    replays = runner.replays
    h.forward(rids, [5, 5], ForwardMode.TARGET_VERIFY)  # checked against the reference (causal)
    assert runner.replays == replays + 1


def test_padded_requests_of_a_tree_graph_get_a_chain_after_a_tree():
    """graph.py:246 the padding's chain copy dropped (`pass`). After a tree verify of 2 requests, one of 1 in the
    same bucket left the padded request with the other request's tree, not the causal chain the padding gets."""
    from hwkv.testing.spec_harness import tree_verify
    h, runner, rids = _tree_graph_harness()
    tree_verify(h, rids, [[-1, 0, 0, 0, 0], [-1, -1, -1, -1, -1]], [[0, 1], [0]])
    h.release()
    tree_verify(h, rids[:1], [[-1, 0, 1, 1, 0]], [[0, 1]])
    blk = 25
    assert torch.equal(runner.tree_mask[blk:2 * blk], runner.chain_mask)
    assert not torch.equal(runner.tree_mask[:blk], runner.chain_mask)  # the live request's own tree


def test_a_tree_batch_on_a_runner_captured_without_trees_is_refused():
    """graph.py:266 `if tree is not None and self.tree_mask is None:` -> `if False:`. A DraftTree verify through
    graphs captured for chains ran causal, ignoring the tree (siblings saw each other), no error."""
    from test_spec_refusals import VERIFY, assert_unchanged, harness, snapshot
    from hwkv.spec import DraftTree
    h, rids = harness()
    runner = h.enable_graphs([2], mode=VERIFY, tokens_per_req=2)
    batch, inputs = h.prepare(rids, [2, 2], VERIFY)
    batch.spec_info = DraftTree.from_parents([[-1, -1], [-1, -1]])
    before = snapshot(h, runner)
    with pytest.raises(ConfigError, match=r"carries a DraftTree: capture its graphs with GraphRunner\(..., tree=True\)"):
        runner.prepare(batch, inputs)
    assert_unchanged(h, before, runner)


def test_a_tree_of_another_size_is_refused_before_any_static_buffer_changes():
    """graph.py:268 the DraftTree mask size check dropped. A mask of one request's 2x2 block for a batch of two went
    on: the inputs were copied into the static buffers, then the mask copy failed (a RuntimeError) with the static
    batch half written."""
    from test_spec_refusals import VERIFY, assert_unchanged, harness, snapshot
    from hwkv.spec import DraftTree
    h, rids = harness()
    runner = h.enable_graphs([2], mode=VERIFY, tokens_per_req=2, tree=True)
    batch, inputs = h.prepare(rids, [2, 2], VERIFY)
    batch.spec_info = DraftTree.from_parents([[-1, 0]])
    before = snapshot(h, runner)
    inputs_before = {k: v.clone() for k, v in runner.inputs.items()}
    with pytest.raises(ShapeError, match="DraftTree.mask has 4 entries; 2 requests of 2 draft tokens need 8"):
        runner.prepare(batch, inputs)
    assert_unchanged(h, before, runner)
    assert all(torch.equal(runner.inputs[k], v) for k, v in inputs_before.items())


def test_tree_graphs_are_refused_outside_target_verify():
    """graph.py:77 `if tree and mode != TARGET_VERIFY:` -> `if False:`. A DECODE runner with tree=True was built (a
    static tree mask no decode batch reads) instead of the ConfigError naming the mode."""
    from hwkv.batch import ForwardMode
    from hwkv.graph import GraphRunner
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv.testing.reference_backend import ReferenceBackend
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    with pytest.raises(ConfigError, match="tree=True is for TARGET_VERIFY graphs, not DECODE"):
        GraphRunner(h.backend, h.model_step, [2], h._input_shapes(), mode=ForwardMode.DECODE, tree=True)


def test_a_graph_batch_of_int32_write_locs_runs_as_its_int64_static_copy():
    """graph.py:197 `check(loc.to(device, int64).contiguous())` -> `check(loc)`. The write locs' values are checked
    as the static int64 copy will hold them; checked as given, int32 locs (any integer dtype runs eagerly and is
    copied into the static batch) were refused with `loc must be int64`."""
    import dataclasses
    from hwkv.batch import ForwardMode
    h, runner, rids = _graph_harness([4])
    batch, inputs = h.prepare(rids, [1, 1, 1], ForwardMode.DECODE)
    batch = dataclasses.replace(batch, out_cache_loc=batch.out_cache_loc.to(torch.int32))
    flat = runner.run(batch, inputs)
    assert runner.replays == 1
    h.complete(rids, [1, 1, 1], inputs, flat)  # checked against the reference
