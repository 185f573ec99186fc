"""The backend refuses a bad batch (init_forward_metadata) and a bad layer call (forward) with a typed error naming the
value and the limit, before it translates, writes K/V or changes anything: every pool buffer, the full-to-SWA
mapping, req_to_token and the allocator are compared before and after. An IDLE batch (no requests) gets empty
metadata, as a DECODE batch of none would."""
import pytest
import torch

import hwkv
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.pool import SWAKVPool

pytestmark = pytest.mark.usefixtures("one_thread")

H, KVH, D, W, CTX, ROWS = 4, 2, 8, 4, 32, 4
DEC, EXT, IDLE = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.IDLE
t = torch.tensor


class Setup:
    """A hybrid pool (layer 0 SWA, layer 1 full), its allocator, a ReqToTokenPool of 4 rows x 32 columns, the CPU
    backend; request row 0 holds 6 prefilled tokens and the slot of its 7th (`loc1`)."""

    def __init__(self):
        self.pool = SWAKVPool(64, 32, 1, torch.float32, KVH, D, [0], [1], "cpu")
        self.alloc = SWATokenToKVPoolAllocator(64, 32, 1, "cpu", self.pool)
        self.rtt = hwkv.ReqToTokenPool(size=ROWS, max_context_len=CTX, device="cpu")
        self.backend = hwkv.make_backend(self.pool, self.rtt, device="cpu", sliding_window=W)
        self.swa_layer = hwkv.AttentionLayer(0, H, KVH, D, sliding_window=W)
        self.full_layer = hwkv.AttentionLayer(1, H, KVH, D)
        loc = self.alloc.alloc(6)
        self.rtt.req_to_token[0, :6] = loc
        prefill = ForwardBatch(EXT, 1, t([0]), t([6]), loc, t([0]), t([6]))
        self.run(prefill)
        self.loc1 = self.alloc.alloc(1)
        self.rtt.req_to_token[0, 6] = self.loc1[0]
        self.decode = ForwardBatch(DEC, 1, t([0]), t([7]), self.loc1)

    def run(self, batch, layers=None):
        self.backend.init_forward_metadata(batch)
        n = batch.num_tokens
        return [self.backend.forward(torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D), layer,
                                     batch) for layer in (layers or (self.swa_layer, self.full_layer))]

    def snapshot(self):
        p = self.pool
        bufs = [b.clone() for sub in (p.full_kv_pool, p.swa_kv_pool) for b in (*sub.k_buffer, *sub.v_buffer)]
        return (bufs, p.full_to_swa_index_mapping.clone(), self.rtt.req_to_token.clone(),
                self.alloc.full_available_size(), self.alloc.swa_available_size(), self.rtt.available_size(),
                self.backend.window_translations)

    def assert_unchanged(self, before, translated=False):
        """`translated`: a metadata step ran (it counts its window-list translation, nothing else may change)."""
        after = self.snapshot()
        if translated:
            before = before[:-1] + after[-1:]
        assert len(before[0]) == len(after[0]) and all(torch.equal(a, b) for a, b in zip(before[0], after[0])), \
            "a pool buffer changed"
        assert torch.equal(before[1], after[1]), "full_to_swa_index_mapping changed"
        assert torch.equal(before[2], after[2]), "req_to_token changed"
        assert before[3:] == after[3:], "allocator, request rows or translation count changed"
        self.alloc.check_integrity()


@pytest.fixture
def s():
    return Setup()


def refused(s, error, match, make, run=False):
    """`make()` builds a batch (or raises at construction); init_forward_metadata (and, with run=True, the layers)
    raise `error`; nothing changed."""
    before = s.snapshot()
    with pytest.raises(error, match=match):
        batch = make()
        s.run(batch) if run else s.backend.init_forward_metadata(batch)
    s.assert_unchanged(before)


# ---- D7: the batch's rows and lengths --------------------------------------------------------------------------

@pytest.mark.parametrize("row", [9, 4, -1])
def test_a_request_row_outside_req_to_token_is_a_loc_error(s, row):
    refused(s, LocError, rf"req_pool_indices hold values in \[{row}, {row}\], allowed range is \[0, {ROWS}\)",
            lambda: ForwardBatch(DEC, 1, t([row]), t([7]), s.loc1))


@pytest.mark.parametrize("mode", [DEC, EXT])
@pytest.mark.parametrize("seq", [-3, 0, CTX + 1, 100])
def test_seq_lens_outside_one_to_max_context_len_are_a_shape_error(s, mode, seq):
    ext = {} if mode == DEC else dict(extend_prefix_lens=t([seq - 1]), extend_seq_lens=t([1]))
    refused(s, ShapeError, rf"seq_lens\[0\] is {seq}; .*\[1, {CTX}\] \(the ReqToTokenPool's max_context_len\)",
            lambda: ForwardBatch(mode, 1, t([0]), t([seq]), s.loc1, **ext), run=True)


def test_seq_lens_cpu_is_what_the_check_reads(s):
    """The engine's host copy is the one read (no device read): a bad host copy is refused too."""
    refused(s, ShapeError, r"seq_lens\[0\] is 100",
            lambda: ForwardBatch(DEC, 1, t([0]), t([7]), s.loc1, seq_lens_cpu=t([100])))


def test_extend_seq_lens_above_seq_lens_are_a_shape_error(s):
    refused(s, ShapeError, r"extend_seq_lens\[0\] is 2; allowed range is \[0, seq_lens\[0\]\] = \[0, 1\]",
            lambda: ForwardBatch(EXT, 1, t([0]), t([1]), torch.cat([s.loc1, s.loc1]), t([0]), t([2])), run=True)


def test_negative_extend_seq_lens_are_a_shape_error(s):
    refused(s, ShapeError, r"extend_seq_lens\[1\] is -1; allowed range is \[0, seq_lens\[1\]\] = \[0, 3\]",
            lambda: ForwardBatch(EXT, 2, t([0, 1]), t([7, 3]), torch.cat([s.loc1, s.loc1]), t([5, 4]), t([2, -1])),
            run=True)


def test_extend_tokens_that_disagree_with_out_cache_loc_are_a_shape_error(s):
    refused(s, ShapeError, r"extend_seq_lens sum to 3 new tokens, out_cache_loc has 1",
            lambda: ForwardBatch(EXT, 1, t([0]), t([7]), s.loc1, t([4]), t([3])), run=True)


@pytest.mark.parametrize("where", ["extend_seq_lens", "extend_seq_lens_cpu", "seq_lens_cpu"])
def test_host_or_extend_lengths_of_another_batch_size_are_a_shape_error(s, where):
    lens = dict(extend_seq_lens=t([1]), extend_seq_lens_cpu=None, seq_lens_cpu=None)
    lens[where] = t([1, 0])
    refused(s, ShapeError, rf"{where} has 2 entries, batch_size is 1",
            lambda: ForwardBatch(EXT, 1, t([0]), t([7]), s.loc1, t([6]), **lens), run=True)


@pytest.mark.parametrize("where", ["req_pool_indices", "seq_lens", "out_cache_loc", "seq_lens_cpu"])
def test_a_list_where_a_tensor_belongs_is_a_shape_error(s, where):
    """A Python list for a tensor field of ForwardBatch is named at construction (it had raised AttributeError
    from the shape checks)."""
    fields = dict(req_pool_indices=t([0]), seq_lens=t([7]), out_cache_loc=s.loc1, seq_lens_cpu=None)
    fields[where] = [7]
    refused(s, ShapeError, rf"{where} must be a torch.Tensor, got list",
            lambda: ForwardBatch(DEC, 1, fields["req_pool_indices"], fields["seq_lens"], fields["out_cache_loc"],
                                 seq_lens_cpu=fields["seq_lens_cpu"]), run=True)


def test_a_good_batch_runs_after_the_refusals(s):
    for make in (lambda: ForwardBatch(DEC, 1, t([9]), t([7]), s.loc1),
                 lambda: ForwardBatch(DEC, 1, t([0]), t([0]), s.loc1),
                 lambda: ForwardBatch(EXT, 1, t([0]), t([7]), s.loc1, t([4]), t([3]))):
        with pytest.raises((LocError, ShapeError)):
            s.backend.init_forward_metadata(make())
    out = s.run(s.decode)
    assert out[0].shape == (1, H, D) and torch.isfinite(out[0]).all()


# ---- D8: a layer call ------------------------------------------------------------------------------------------

def forward_refused(s, error, match, q, k, v, layer, save=True):
    s.backend.init_forward_metadata(s.decode)
    before = s.snapshot()
    with pytest.raises(error, match=match):
        s.backend.forward(q, k, v, layer, s.decode, save_kv_cache=save)
    s.assert_unchanged(before)


def test_a_2d_query_or_kv_of_the_wrong_size_is_a_shape_error(s):
    q, k, v = torch.randn(1, H, D), torch.randn(1, KVH, D), torch.randn(1, KVH, D)
    forward_refused(s, ShapeError, r"q has shape \[1, 31\], expected \[1, 32\]", torch.randn(1, 31), k, v, s.swa_layer)
    forward_refused(s, ShapeError, r"q has shape \[2, 32\], expected \[1, 32\]", torch.randn(2, 32), k, v, s.swa_layer)
    forward_refused(s, ShapeError, r"k has shape \[1, 15\], expected \[1, 16\]", q, torch.randn(1, 15), v, s.swa_layer)
    forward_refused(s, ShapeError, r"v has shape \[1, 17\], expected \[1, 16\]", q, k, torch.randn(1, 17), s.full_layer)
    out = s.backend.forward(q.reshape(1, H * D), k.reshape(1, KVH * D), v.reshape(1, KVH * D), s.swa_layer, s.decode)
    assert out.shape == (1, H, D)  # 2-D inputs of the right size still run


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("field, layer_args, want", [
    ("num_kv_heads", (4, 4, 8, None), r"num_kv_heads=4 .* the pool's group holds 2"),
    ("head_dim", (4, 2, 16, None), r"head_dim=16 .* the pool's group holds 8"),
    ("v_head_dim", (4, 2, 8, 4), r"v_head_dim=4 .* the pool's group holds 8"),
])
def test_a_layer_whose_geometry_differs_from_its_pool_group_is_a_shape_error(s, save, field, layer_args, want):
    h, kvh, d, dv = layer_args
    for lid, window in ((0, W), (1, None)):
        layer = hwkv.AttentionLayer(lid, h, kvh, d, v_head_dim=dv, sliding_window=window)
        q, k, v = torch.randn(1, h, d), torch.randn(1, kvh, d), torch.randn(1, kvh, dv or d)
        forward_refused(s, ShapeError, rf"layer {lid}: {want}", q, k, v, layer, save)


def test_sinks_on_another_device_or_of_an_integer_dtype_are_refused_before_the_write(s):
    q, k, v = torch.randn(1, H, D), torch.randn(1, KVH, D), torch.randn(1, KVH, D)
    meta = hwkv.AttentionLayer(0, H, KVH, D, sliding_window=W, sinks=torch.zeros(H, device="meta"))
    forward_refused(s, ShapeError, r"layer 0: sinks live on meta, the pool on cpu", q, k, v, meta)
    ints = hwkv.AttentionLayer(0, H, KVH, D, sliding_window=W, sinks=torch.zeros(H, dtype=torch.int64))
    forward_refused(s, ShapeError, r"layer 0: sinks are torch.int64, .*floating", q, k, v, ints)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_a_query_that_is_not_floating_point_is_a_shape_error(s, dtype):
    q, k, v = torch.ones(1, H, D, dtype=dtype), torch.randn(1, KVH, D), torch.randn(1, KVH, D)
    forward_refused(s, ShapeError, rf"q is {dtype}, .*floating", q, k, v, s.swa_layer)
    forward_refused(s, ShapeError, rf"q is {dtype}, .*floating", q, None, None, s.full_layer, save=False)


def test_the_caller_tensors_are_left_as_they_were(s):
    s.backend.init_forward_metadata(s.decode)
    q, k, v = torch.randn(1, H * D), torch.randn(1, KVH * D), torch.randn(1, KVH * D)
    copies = [x.clone() for x in (q, k, v)]
    s.backend.forward(q, k, v, s.swa_layer, s.decode)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip((q, k, v), copies))


def test_a_layer_the_pool_lacks_stays_a_config_error(s):
    s.backend.init_forward_metadata(s.decode)
    q, kv = torch.randn(1, H, D), torch.randn(1, KVH, D)
    for save in (True, False):
        with pytest.raises(ConfigError, match=r"layer 5 is in neither group of the pool; its layer ids are \[0, 1\]"):
            s.backend.forward(q, kv, kv, hwkv.AttentionLayer(5, H, KVH, D), s.decode, save_kv_cache=save)


# ---- D9: IDLE --------------------------------------------------------------------------------------------------

def test_an_idle_batch_gets_empty_metadata_and_its_layers_run_on_nothing(s):
    e = torch.zeros(0, dtype=torch.int64)
    batch = ForwardBatch(IDLE, 0, e, e, e)
    before = s.snapshot()
    md = s.backend.init_forward_metadata(batch)
    assert md.batch_size == 0 and md.write_loc.loc.numel() == 0 and md.qo_indptr.tolist() == [0]
    assert md.full.indptr.tolist() == [0] and md.full.indices.numel() == 0
    assert all(lst.indices.numel() == 0 for lst in md.windows.values())
    for layer in (s.swa_layer, s.full_layer):
        out = s.backend.forward(torch.randn(0, H, D), torch.randn(0, KVH, D), torch.randn(0, KVH, D), layer, batch)
        assert out.shape == (0, H, D)
    s.assert_unchanged(before, translated=True)
    out = s.run(s.decode)  # the next forward runs as usual
    assert out[0].shape == (1, H, D)


@pytest.mark.parametrize("bs, n", [(1, 0), (0, 1)])
def test_an_idle_batch_with_requests_or_tokens_is_a_shape_error(s, bs, n):
    rows = torch.zeros(bs, dtype=torch.int64)
    refused(s, ShapeError, r"IDLE|batch_size", lambda: ForwardBatch(IDLE, bs, rows, rows + 7, s.loc1[:n]))
