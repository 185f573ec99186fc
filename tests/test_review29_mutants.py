"""Review 29 (test-suite audit by mutation): single-line mutants of hwkv_cpu/kernels_decode.py,
hwkv_cpu/kernels_dense.py, hwkv_cpu/kernels_extend.py and hwkv/integrations/ that the rest of the suite let through,
each pinned here by a small deterministic CPU test that passes on the code as it is and fails with the mutant applied
(each test's docstring names its mutant as `module:line  original -> mutant`).
"""
import threading
import time

import pytest
import torch

from hwkv import reference
from hwkv_cpu import kernels, kernels_decode, kernels_extend
from hwkv_cpu.kernels_decode import Params

pytestmark = pytest.mark.usefixtures("one_thread")

F32 = torch.float32


def _pool(n, kvh=1, d=4, dv=None, seed=0, dtype=F32, vdtype=None):
    """K/V pools of n + 1 slots (slot 0 unused) filled with random values."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n + 1, kvh, d, generator=g)
    v = torch.randn(n + 1, kvh, dv or d, generator=g)
    return k.to(dtype), v.to(vdtype or dtype)


def _ref_one(q, k, v, q_pos, k_pos, scaling, window=None, cap=0.0, sinks=None):
    return reference.attention(q.float(), k.float(), v.float(), torch.as_tensor(q_pos), torch.as_tensor(k_pos),
                               scaling, window, cap, sinks)


# ------------------------------------------------------------------------------------------- kernels_decode.py
def test_parallel_map_at_one_thread_runs_every_item_in_the_callers_thread():
    """kernels_decode.py:86  `min(torch.get_num_threads(), len(items))` -> `max(...)`. With the caller at one torch
    thread, a list of items went to len(items) pool threads (oversubscribing a CPU the caller had asked to leave
    alone); the results were the same, so no test saw it."""
    torch.set_num_threads(1)
    me = threading.get_ident()

    def fn(i):
        if i == 0:
            time.sleep(0.2)  # leaves any helper thread time to take the other items
        return threading.get_ident()

    assert kernels_decode.parallel_map(fn, list(range(4))) == [me] * 4


def test_parallel_map_grows_a_smaller_pool_to_the_thread_count(monkeypatch):
    """kernels_decode.py:117  `_POOL._max_workers < threads - 1` -> `> threads - 1`. A pool made for fewer threads
    was kept, so a later call at more threads ran its items on fewer threads than asked (the results were the same).
    Here four items wait on a 4-party barrier: only four threads at once get through."""
    from concurrent.futures import ThreadPoolExecutor

    small = ThreadPoolExecutor(1, thread_name_prefix="review29")
    monkeypatch.setattr(kernels_decode, "_POOL", small)
    barrier = threading.Barrier(4, timeout=5)
    torch.set_num_threads(4)
    try:
        idents = kernels_decode.parallel_map(lambda i: (barrier.wait(), threading.get_ident())[1], list(range(4)))
        assert len(set(idents)) == 4
    finally:
        torch.set_num_threads(1)
        if kernels_decode._POOL is not small:
            kernels_decode._POOL.shutdown(wait=True)
        small.shutdown(wait=True)


@pytest.mark.parametrize("kdt, vdt", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_decode_reads_k_and_v_pools_of_different_dtypes(kdt, vdt):
    """kernels_decode.py:197  `... if v_buf.dtype != cdt else None` -> `... if k_buf.dtype != cdt else None`. V's
    upcast scratch followed K's dtype: a pool whose K and V differ in dtype (which the kernels accept, computing in
    fp32) read V through the wrong path; no test mixed the two dtypes."""
    k, v = _pool(6, kvh=1, d=4, seed=1, dtype=kdt, vdtype=vdt)
    q = torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(2))
    slots = torch.tensor([3, 1, 5, 2])
    out = torch.full((1, 2, 4), float("nan"))
    kernels.decode_attention(q, k, v, torch.tensor([0, 4]), slots, torch.tensor([0]), torch.tensor([3]), out,
                             0.5, None, None, None, None, None)
    want = _ref_one(q, k[slots], v[slots], [3], torch.arange(4), 0.5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_extend_block_that_sees_no_listed_key_outputs_zeros_not_the_last_blocks_state():
    """kernels_decode.py:290  `return self.acc.zero_()` -> `return self.acc`. A query block with no key to read and
    no sinks (a list that ends before the block's window starts) returned the workspace's accumulator as left by the
    previous block instead of zeros: here the block of queries 8, 9 (window 2) over a list of positions 0..5."""
    k, v = _pool(6, kvh=1, d=4, seed=3)
    q = torch.randn(6, 1, 4, generator=torch.Generator().manual_seed(4))
    out = torch.full((6, 1, 4), float("nan"))
    p = Params(0.5, 0.0, 1.0, 2, F32)
    kernels_extend.extend_torch(q, k, v, [0, 6], torch.arange(1, 7), [0], [0, 6], [4], out, p, None,
                                chunk=4, rows=2)  # blocks of two queries: positions 4-5, 6-7, 8-9
    want = _ref_one(q, k[1:7], v[1:7], torch.arange(4, 10), torch.arange(6), 0.5, window=2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[4:], torch.zeros(2, 1, 4))


def test_decode_of_more_requests_than_keys_per_step():
    """kernels_decode.py:346  `max(MIN_CHUNK, keys_per_step // live)` -> `min(...)`. Below 1024 live requests the
    chunk only shrank (same outputs); above, it was 0 and the column loop stopped with a ValueError. Each of 1100
    one-key requests outputs its key's value."""
    n = 1100
    k, v = _pool(n, kvh=1, d=2, seed=5)
    q = torch.randn(n, 1, 2, generator=torch.Generator().manual_seed(6))
    out = torch.full((n, 1, 2), float("nan"))
    kernels.decode_attention(q, k, v, torch.arange(n + 1), torch.arange(1, n + 1), torch.zeros(n, dtype=torch.int64),
                             torch.zeros(n, dtype=torch.int64), out, None, None, None, None, None, None)
    torch.testing.assert_close(out, v[1:], atol=1e-6, rtol=1e-6)


def test_split_columns_leaves_out_empty_column_ranges():
    """kernels_decode.py:413  `if hi > lo` -> `if hi >= lo`. Where one column holds enough keys for two goals (one
    long request among many one-key ones) the bounds repeat, and the empty range (1, 1) became a part: a state that
    never stepped, whose (m, l, acc) are whatever the thread's workspace held, merged into the output."""
    assert kernels_decode._split_columns([100] + [1] * 200, 4, 1) == [(0, 1), (1, 25), (25, 100)]


def test_decode_with_every_score_far_below_zero_still_averages_the_values():
    """kernels_decode.py:438  `torch.full((rows, g, 1), NEG_BIG, ...)` -> `torch.full((rows, g, 1), 0.0, ...)`. The
    merge's running max started at 0 instead of the floor: with every score near -200 (exp underflows fp32) the
    merged l and acc were 0 and the output zeros instead of the values' average."""
    k = torch.ones(4, 1, 2)
    v = torch.arange(8.0).view(4, 1, 2)
    q = torch.full((1, 1, 2), -100.0)
    out = torch.full((1, 1, 2), float("nan"))
    kernels.decode_attention(q, k, v, torch.tensor([0, 3]), torch.tensor([1, 2, 3]), torch.tensor([0]),
                             torch.tensor([2]), out, 1.0, None, None, None, None, None)
    torch.testing.assert_close(out, v[1:].mean(0, keepdim=True))


# ------------------------------------------------------------------------------------------- kernels_dense.py
def _dense_plan(lens, ext, max_elements=1 << 21, all_visible=False, window=0, kvh=1, g=1, d=4, dv=4, table=None,
                q_pos0=None, indices=None):
    from hwkv_cpu.kernels_dense import plan_dense

    indptr = torch.tensor([0] + list(lens)).cumsum(0)
    indices = torch.arange(1, sum(lens) + 1) if indices is None else indices
    decode = ext is None
    q_pos0 = torch.tensor([n - (1 if decode else e) for n, e in zip(lens, ext or [1] * len(lens))]) \
        if q_pos0 is None else q_pos0
    qo = None if decode else torch.tensor([0] + list(ext)).cumsum(0)
    return plan_dense(indptr, indices, torch.zeros(len(lens), dtype=torch.int64), q_pos0, qo, max(lens),
                      1 if decode else max(ext), window, kvh, g, d, dv, max_elements, table, all_visible)


def test_dense_plan_counts_every_query_rows_scores_against_max_elements():
    """kernels_dense.py:79  `kvh * g * tq` -> `kvh * g`. The size bound left out the query rows of an extend: a plan
    whose score table alone was tq times the limit was made (memory the bound is there to cap). 2 requests x 8 keys x
    (1 x (4 + 4) + 1 x 1 x 8) = 256 elements: declined at 255, made at 256."""
    assert _dense_plan([8, 8], [8, 8], max_elements=255) is None
    assert _dense_plan([8, 8], [8, 8], max_elements=256) is not None


def test_dense_plan_ignores_all_visible_for_extend():
    """kernels_dense.py:92  `if decode and all_visible and ...` -> `if all_visible and ...`. all_visible is the decode
    shortcut (every key visible to the one query); an extend plan given it went unmasked, its early queries seeing
    the keys after them."""
    plan = _dense_plan([4], [4], all_visible=True)
    assert plan is not None and plan.bias is not None
    causal = torch.zeros(4, 4).masked_fill_(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(plan.bias.view(4, 4), causal)


def test_dense_plan_padding_reads_only_listed_slots_never_the_buffers_tail():
    """kernels_dense.py:82  `n = min(int(indptr[-1]), int(indices.shape[0]))` -> `n = int(indices.shape[0])`, and
    kernels_dense.py:87  `clamp_(max=n - 1)` -> `clamp_(max=n)`. A short request's padding columns read past the
    listed entries into the index buffer's unspecified tail (a graph buffer's stale or garbage slots): here 999 in a
    pool of 8 slots, an index error at the gather."""
    from hwkv_cpu.kernels_dense import dense_attention

    indices = torch.tensor([1, 2, 3, 4, 999, 999])  # 4 listed entries, then the tail
    plan = _dense_plan([3, 1], None, indices=indices)
    assert plan is not None and int(plan.rows.max()) < 8
    k, v = _pool(7, kvh=1, d=4, seed=9)
    q = torch.randn(2, 1, 4, generator=torch.Generator().manual_seed(10))
    out = torch.full((2, 1, 4), float("nan"))
    dense_attention(q, k, v, plan, out, 0.5, 0.0, 1.0, None)
    torch.testing.assert_close(out[:1], _ref_one(q[:1], k[1:4], v[1:4], [2], torch.arange(3), 0.5))
    torch.testing.assert_close(out[1:], v[4:5])


def test_dense_plan_serves_an_extend_beside_a_request_with_no_query_and_no_key():
    """kernels_dense.py:122  `real = seen if decode else seen | (t[None, :] >= ext[:, None])` -> `real = seen`. A
    request with no query in the extend (its rows all padding) and no listed key counted as a real query without a
    visible key, and the whole batch was declined to the chunked kernels. And kernels_dense.py:111 drops
    `.clamp_(0, max(total - 1, 0))`: that request's padding row (the last request) pointed one past q's rows, an
    index error at the query gather."""
    from hwkv_cpu.kernels_dense import plan_dense

    plan = plan_dense(torch.tensor([0, 3, 3]), torch.tensor([1, 2, 3]), torch.tensor([0, 0]), torch.tensor([1, 0]),
                      torch.tensor([0, 2, 2]), 3, 2, 0, 1, 1, 4, 4)
    assert plan is not None
    from hwkv_cpu.kernels_dense import dense_attention

    k, v = _pool(3, kvh=1, d=4, seed=21)
    q = torch.randn(2, 1, 4, generator=torch.Generator().manual_seed(22))
    out = torch.full((2, 1, 4), float("nan"))
    dense_attention(q, k, v, plan, out, 0.5, 0.0, 1.0, None)  # the empty request's padding row reads no token past q
    torch.testing.assert_close(out, _ref_one(q, k[1:4], v[1:4], [1, 2], torch.arange(3), 0.5))


def test_dense_attention_computes_fp64_pools_in_fp64():
    """kernels_dense.py:133  `return torch.float64 if pool_dtype == torch.float64 else torch.float32` ->
    `return torch.float32 if ...`. fp64 pools were computed in fp32 (errors ~1e-7 where fp64 gives ~1e-15)."""
    from hwkv_cpu.kernels_dense import compute_dtype, dense_attention

    assert compute_dtype(torch.float64) == torch.float64
    k, v = _pool(5, kvh=1, d=4, seed=11, dtype=torch.float64)
    q = torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    plan = _dense_plan([5], None, g=2)
    out = torch.full((1, 2, 4), float("nan"), dtype=torch.float64)
    dense_attention(q, k, v, plan, out, 0.5, 0.0, 1.0, None)
    s = torch.einsum("hd,kd->hk", q[0], k[1:6, 0]) * 0.5
    want = (torch.softmax(s, -1) @ v[1:6, 0])[None]
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_dense_decode_all_visible_shortcut_keeps_the_window_mask_one_key_past_the_window():
    """kernels_dense.py:92  `(not window or keys <= window)` -> `(not window or keys <= window + 1)`. With every
    listed key ending at the query and one key more than the window, the shortcut dropped the mask and the query saw
    the key just outside its window."""
    from hwkv_cpu.kernels_dense import dense_attention

    plan = _dense_plan([4], None, all_visible=True, window=3)
    assert plan.bias is not None
    k, v = _pool(4, kvh=1, d=4, seed=13)
    q = torch.randn(1, 1, 4, generator=torch.Generator().manual_seed(14))
    out = torch.full((1, 1, 4), float("nan"))
    dense_attention(q, k, v, plan, out, 0.5, 0.0, 1.0, None)
    torch.testing.assert_close(out, _ref_one(q, k[1:5], v[1:5], [3], torch.arange(4), 0.5, window=3))


def test_dense_kept_sink_column_is_in_the_compute_dtype_whatever_the_sinks_dtype():
    """kernels_dense.py:150  `dtype=cdt` -> `dtype=sinks.dtype`. The kept column took the sinks' dtype: fp64 sinks
    over an fp32 pool made the softmax fp64 and its matmul with the fp32 values a dtype error."""
    from hwkv_cpu.kernels_dense import dense_attention, kept_sink_column

    plan = _dense_plan([5], None, g=2)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    col, dst, src = kept_sink_column(sinks, plan, torch.float32)
    assert col.dtype == torch.float32
    dst.copy_(src)
    k, v = _pool(5, kvh=1, d=4, seed=15)
    q = torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(16))
    out = torch.full((1, 2, 4), float("nan"))
    dense_attention(q, k, v, plan, out, 0.5, 0.0, 1.0, sinks, sink_col=col)
    want = _ref_one(q, k[1:6], v[1:6], [4], torch.arange(5), 0.5, sinks=sinks.float())
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_dense_decode_writes_a_non_contiguous_out():
    """kernels_dense.py:201  drops ` and out.is_contiguous()`. A decode's out that is a strided view (here [B, H, Dv]
    over an [H, B, Dv] buffer) went to `bmm(..., out=out.view(B * KVH, G, Dv))`, a view such an out cannot give."""
    from hwkv_cpu.kernels_dense import dense_attention

    plan = _dense_plan([3, 4], None, kvh=2, g=1)
    k, v = _pool(7, kvh=2, d=4, seed=19)
    q = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(20))
    out = torch.full((2, 2, 4), float("nan")).transpose(0, 1)
    assert not out.is_contiguous()
    dense_attention(q, k, v, plan, out, 0.5, 0.0, 1.0, None)
    torch.testing.assert_close(out[:1], _ref_one(q[:1], k[1:4], v[1:4], [2], torch.arange(3), 0.5))
    torch.testing.assert_close(out[1:], _ref_one(q[1:], k[4:8], v[4:8], [3], torch.arange(4), 0.5))


def test_dense_plan_bound_counts_the_value_head_dim():
    """kernels_dense.py:79  `kvh * (d + dv)` -> `kvh * d`. The size bound left out the gathered values: with
    Dv = 3 x D a plan of about twice the limit was made. 1 request x 8 keys x (1 x (4 + 12) + 1 x 1 x 1) = 136
    elements: declined at 135, made at 136."""
    assert _dense_plan([8], None, d=4, dv=12, max_elements=135) is None
    assert _dense_plan([8], None, d=4, dv=12, max_elements=136) is not None


def test_dense_decode_hides_the_padding_of_a_list_that_ends_before_its_query():
    """kernels_dense.py:95  `lens = indptr[1:] - indptr[:-1]` -> `lens = indptr[1:]`, and kernels_dense.py:116
    `col >= lens[:, None]` -> `col > lens[:, None]`. Padding columns are hidden by causality only where a list ends
    at its query; request 1 here lists positions 0-1 and queries at position 5, so its padding column 2 (a repeated
    listed slot) was attended as a key at position 2."""
    from hwkv_cpu.kernels_dense import dense_attention

    plan = _dense_plan([3, 2], None, q_pos0=torch.tensor([2, 5]))
    k, v = _pool(5, kvh=1, d=4, seed=23)
    q = torch.randn(2, 1, 4, generator=torch.Generator().manual_seed(24))
    out = torch.full((2, 1, 4), float("nan"))
    dense_attention(q, k, v, plan, out, 0.5, 0.0, 1.0, None)
    torch.testing.assert_close(out[:1], _ref_one(q[:1], k[1:4], v[1:4], [2], torch.arange(3), 0.5))
    torch.testing.assert_close(out[1:], _ref_one(q[1:], k[4:6], v[4:6], [5], torch.arange(2), 0.5))


# ------------------------------------------------------------------------------------------- hwkv/integrations/
class _Module:
    """What `LayerTable.get` reads of a transformers attention module."""

    def __init__(self, layer_idx, training=False):
        self.layer_idx, self.training = layer_idx, training


def _qkv(h=4, kvh=2, t=3, d=8, dv=None):
    return torch.zeros(1, h, t, d), torch.zeros(1, kvh, t, d), torch.zeros(1, kvh, t, dv or d)


def _table(is_swa=(False, True), window=8, shape=None):
    from hwkv.integrations.hf_attention import LayerTable

    return LayerTable(list(is_swa), window, shape)


def test_layer_table_refuses_a_later_call_with_another_scaling():
    """hf_attention.py:43  `elif scaling is not None and scaling != layer.scaling:` -> `elif False:`. A layer called
    again with another scaling attended with its first call's, silently."""
    from hwkv.errors import ConfigError

    table, m = _table(), _Module(0)
    table.get(m, *_qkv(), 0.25, None, None, None)
    assert table.get(m, *_qkv(), 0.25, None, None, None).scaling == 0.25
    with pytest.raises(ConfigError, match="scaling 0.5 differs from its first call's 0.25"):
        table.get(m, *_qkv(), 0.5, None, None, None)


def test_layer_table_takes_sinks_of_another_dtype_at_the_same_address():
    """hf_attention.py:46  drops `or sinks.dtype != layer.sinks.dtype`. Sinks reinterpreted in place as another dtype
    (same address) kept the layer on the old tensor, whose dtype the backends key their kept state on."""
    table, m = _table(), _Module(0)
    first = torch.zeros(8)
    table.get(m, *_qkv(), None, None, None, first[:4])
    other = first.view(torch.bfloat16)[:4]
    assert other.data_ptr() == first.data_ptr()
    assert table.get(m, *_qkv(), None, None, None, other).sinks.dtype == torch.bfloat16


def test_layer_table_takes_sinks_on_a_layer_first_called_without_them():
    """hf_attention.py:46  drops `layer.sinks is None or `. A layer first called without sinks and later with them
    raised AttributeError (None has no data_ptr) instead of taking them."""
    table, m = _table(), _Module(1)
    assert table.get(m, *_qkv(), None, 8, None, None).sinks is None
    sinks = torch.ones(4)
    assert table.get(m, *_qkv(), None, 8, None, sinks).sinks.data_ptr() == sinks.data_ptr()


def test_layer_table_refuses_replaced_sinks_under_captured_graphs():
    """hf_attention.py:51  `if self.frozen:` -> `if False:`. With graphs captured (which replay the old sinks'
    address) sinks replaced by another tensor were taken by the layer, not refused."""
    from hwkv.errors import ConfigError

    table, m = _table(), _Module(0)
    table.get(m, *_qkv(), None, None, None, torch.zeros(4))
    table.frozen = True
    with pytest.raises(ConfigError, match="its sinks were replaced"):
        table.get(m, *_qkv(), None, None, None, torch.ones(4))


def test_layer_table_records_replaced_sinks_as_checked():
    """hf_attention.py:57  `layer.sinks_checked = storage_key(layer.sinks)` -> `pass`. Replaced sinks whose values
    the table had just checked were not recorded as checked, so the backend checked them again at every forward."""
    from hwkv.layer import storage_key

    table, m = _table(), _Module(0)
    table.get(m, *_qkv(), None, None, None, torch.zeros(4))
    new = torch.ones(4)
    layer = table.get(m, *_qkv(), None, None, None, new)
    assert layer.sinks_checked == storage_key(new)


@pytest.mark.parametrize("layer_idx", [2, None, -1])
def test_layer_table_refuses_a_layer_idx_outside_the_config(layer_idx):
    """hf_attention.py:63  `0 <= layer_id < len(self.is_swa)` -> `<= len(...)` (layer_idx 2 of 2 layers: an
    IndexError), and drops `not isinstance(layer_id, int) or ` (layer_idx None: a TypeError), not the ConfigError
    naming the layer count."""
    from hwkv.errors import ConfigError

    with pytest.raises(ConfigError, match="the config has 2 layers"):
        _table().get(_Module(layer_idx), *_qkv(), None, None, None, None)


@pytest.mark.parametrize("layer_idx, window", [(0, 8), (1, None), (1, 4)])
def test_layer_table_refuses_a_sliding_window_the_config_does_not_give(layer_idx, window):
    """hf_attention.py:67  `if sliding_window != expected:` -> `if False:`. A full layer passed a window (or a sliding
    layer none, or another one) was built with the config's kind anyway, the model's own window ignored."""
    from hwkv.errors import ConfigError

    with pytest.raises(ConfigError, match=f"passes sliding_window={window!r}"):
        _table().get(_Module(layer_idx), *_qkv(), None, window, None, None)


def test_layer_table_refuses_a_v_head_dim_other_than_the_pools():
    """hf_attention.py:75  `if got != want:` -> `if got[:2] != want[:2]:`. A layer whose V head dim differed from the
    one the pools were built with (same KV heads and K head dim) went on to the backend."""
    from types import SimpleNamespace

    from hwkv.errors import ConfigError

    shape = SimpleNamespace(num_kv_heads=2, head_dim=8, v_head_dim=8, swa_num_kv_heads=2, swa_head_dim=8,
                            swa_v_head_dim=8, name="tiny")
    table = _table(shape=shape)
    table.get(_Module(0), *_qkv(), None, None, None, None)  # the geometry the pools hold
    with pytest.raises(ConfigError, match=r"\(2, 8, 6\), the pools were built from the config as \(2, 8, 8\)"):
        table.get(_Module(1), *_qkv(dv=6), None, 8, None, None)


def test_attention_refuses_a_query_batch_of_two_rows():
    """hf_attention.py:99  `if query.shape[0] != 1:` -> `if False:`. A [2, H, T, D] query (the batch not packed into
    one row) reached the backend as its first row only, the second row's tokens silently dropped."""
    from hwkv.errors import ShapeError
    from hwkv.integrations.hf_attention import ForwardContext

    class Backend:
        def forward(self, q, k, v, layer, batch):
            return torch.zeros(q.shape[0], q.shape[1], v.shape[-1])

    ctx = ForwardContext(Backend(), None, _table())
    q, k, v = _qkv()
    assert ctx.attend(_Module(0), q, k, v, None, None, None, None).shape == (1, 3, 4, 8)
    with pytest.raises(ShapeError, match="one row"):
        ctx.attend(_Module(0), q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                   None, None, None, None)


def test_attention_hands_the_backend_a_contiguous_last_dimension():
    """hf_attention.py:110  `t if t.stride(-1) == 1 else t.contiguous()` -> `t if True else ...`. q/k/v whose head
    dim is strided (a slice of a wider projection) reached the backend strided, where its kernels and K/V stores read
    the last dimension as contiguous."""
    from hwkv.integrations.hf_attention import ForwardContext

    seen = []

    class Backend:
        def forward(self, q, k, v, layer, batch):
            seen.extend(t.stride(-1) for t in (q, k, v))
            return torch.zeros(q.shape[0], q.shape[1], v.shape[-1])

    q, k, v = (t.repeat_interleave(2, -1)[..., ::2] for t in _qkv())
    assert q.stride(-1) == 2
    ForwardContext(Backend(), None, _table()).attend(_Module(0), q, k, v, None, None, None, None)
    assert seen == [1, 1, 1]


def test_attention_function_refuses_an_attention_mask():
    """hf_attention.py:127  `if attention_mask is not None:` -> `if False:`. A model called with an attention mask had
    it dropped silently (hwkv masks by request and window itself), not refused."""
    from hwkv.errors import ConfigError
    from hwkv.integrations.hf_attention import ForwardContext, hwkv_attention

    class Backend:
        def forward(self, q, k, v, layer, batch):
            return torch.zeros(q.shape[0], q.shape[1], v.shape[-1])

    ctx = ForwardContext(Backend(), None, _table())
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="got an attention_mask of shape"):
        hwkv_attention(_Module(0), q, k, v, torch.ones(1, 1, 3, 3), hwkv_forward=ctx)
    assert ctx.calls == 0


def test_the_last_runner_closed_forgets_the_model():
    """runner.py:52  `if _OPEN.get(model) is opened:` -> `is not opened`. The last runner closed on a model left its
    entry behind (count 0), so the next runner opened on it took the implementation recorded before the first one
    (not the model's current one) and gave that back when it closed."""
    from hwkv.integrations.runner import _OPEN, _give_back_attention, _OpenOn

    class Model:
        impl = "hwkv"

        def set_attn_implementation(self, impl):
            self.impl = impl

    model, opened = Model(), _OpenOn("eager", 1)
    _OPEN[model] = opened
    _give_back_attention(model, opened)
    assert model.impl == "eager" and model not in _OPEN


def _tiny_gpt_oss(positions: int):
    """A tiny random GPT-OSS (2 layers, one of them sliding, window 8) of `positions` positions, eager attention."""
    transformers = pytest.importorskip("transformers", reason="hwkv's test extra")
    cfg = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    max_position_embeddings=positions, sliding_window=8, num_local_experts=2,
                                    num_experts_per_tok=1, tie_word_embeddings=False, eos_token_id=None,
                                    pad_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def test_runner_default_context_is_the_models_positions_capped_at_4096():
    """runner.py:72  `min(int(getattr(cfg, "max_position_embeddings", 4096) or 4096), 4096)` -> `max(...)`. A model of
    256 positions got pools for 4096-token requests (16 x the KV memory it can use)."""
    from hwkv.integrations.transformers import HybridRunner

    model = _tiny_gpt_oss(positions=256)
    with HybridRunner(model, max_running=2, page_size=4, graphs="off") as runner:
        assert runner.stats.plan.context == 256


def test_runner_refuses_a_step_after_the_model_left_hwkv_attention_before_running_it():
    """runner.py:135  `if impl != ATTN_IMPLEMENTATION:` -> `if False:`. A step after `set_attn_implementation("eager")`
    ran the model's whole forward under another attention (caught only afterwards by the layer count; a graph replay
    would not have been caught at all) instead of being refused before the model was touched."""
    from hwkv.errors import ConfigError
    from hwkv.integrations.transformers import HybridRunner, SamplingParams

    model = _tiny_gpt_oss(positions=64)
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    with HybridRunner(model, max_running=2, page_size=4, graphs="off") as runner:
        runner.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
        model.set_attn_implementation("eager")
        with pytest.raises(ConfigError, match="attention implementation is 'eager'") as e:
            runner.step()
        assert "forward ran" not in str(e.value) and forwards == []


def test_runner_refuses_a_step_after_the_model_moved_to_another_device():
    """runner.py:150  drops ` or w.device != device`. A model moved to another device (here its input embeddings to
    "meta") under an open runner went on to a forward over pools on the old device, not the ConfigError naming
    the move."""
    from hwkv.errors import ConfigError
    from hwkv.integrations.transformers import HybridRunner, SamplingParams

    model = _tiny_gpt_oss(positions=64)
    with HybridRunner(model, max_running=2, page_size=4, graphs="off") as runner:
        runner.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
        model.get_input_embeddings().to("meta")
        with pytest.raises(ConfigError, match="on meta while this runner is open"):
            runner.step()
