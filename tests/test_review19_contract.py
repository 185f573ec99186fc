"""Review 19 (the documents against the code, the public API contract): refusals come before any change, typed errors
from the public constructors, and the docs/bad-inputs.md rows the code had contradicted. Every refusal compares the
pools' buffers, the full->SWA table, req_to_token, the allocator and the prefix cache before and after, through the
snapshot helpers of the existing refusal tests."""
import math

import pytest
import torch

import hwkv
from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, DeviceError, NotAllocatedError
from hwkv.layer import AttentionLayer
from hwkv.release import release_out_of_window, release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.spec import DraftTree

from test_backend_refusals import D, H, KVH, W, Setup as BackendSetup, forward_refused  # noqa: E402
from test_cache_pool_defects import Setup as CacheSetup  # noqa: E402
from test_pool_refusals import SIZE, SIZE_SWA, Hybrid  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
t = torch.tensor
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")

# ---- 1. a layer of the SWA group whose window the backend lacks: refused before its K/V are stored ---------------
SWA_WINDOW_REFUSALS = [
    (16, rf"layer 0 has sliding_window=16 but the backend was built for windows \[{W}\]; pass sliding_window= to "
         "make_backend"),
    (None, r"layer 0 sits in the SWA pool but has no sliding_window"),
]


def _refused_with_allocator(s, match, layer, batch_tokens=1):
    """forward_refused (pool buffers, table, req_to_token, free counts) plus the allocator's whole state."""
    q, k, v = (torch.randn(batch_tokens, H, D), torch.full((batch_tokens, KVH, D), 7.0),
               torch.full((batch_tokens, KVH, D), 7.0))
    for save in (True, False):
        before = s.alloc.integrity_snapshot()
        forward_refused(s, ConfigError, match, q, k, v, layer, save)
        assert same_snapshot(before, s.alloc.integrity_snapshot())


@pytest.mark.parametrize("window, match", SWA_WINDOW_REFUSALS, ids=["other-W", "no-W"])
def test_an_swa_group_layer_without_the_backends_window_is_refused_before_its_kv_are_stored(window, match):
    s = BackendSetup()
    _refused_with_allocator(s, match, AttentionLayer(0, H, KVH, D, sliding_window=window))
    out = s.run(s.decode)  # the layer id's kept geometry does not outlive the refusal: the right layer still runs
    assert out[0].shape == (1, H, D) and torch.isfinite(out[0]).all()


class _TreeSetup(BackendSetup):
    """BackendSetup whose backend runs a verify tree decode-like (tree_verify="decode"), and a TARGET_VERIFY batch of
    three drafts (a root and two children) after the 6 prefilled tokens, so forward takes the tree-decode path."""

    def __init__(self):
        super().__init__()
        self.backend = hwkv.make_backend(self.pool, self.rtt, device="cpu", sliding_window=W, tree_verify="decode")
        locs = torch.cat([self.loc1, self.alloc.alloc(2)])
        self.rtt.write(0, 6, locs)
        self.decode = ForwardBatch(ForwardMode.TARGET_VERIFY, 1, t([0]), t([9]), locs, t([6]), t([3]),
                                   spec_info=DraftTree.from_parents([[-1, 0, 0]], device="cpu"))


@pytest.mark.parametrize("window, match", SWA_WINDOW_REFUSALS, ids=["other-W", "no-W"])
def test_the_tree_decode_path_refuses_the_same_layers_before_the_store(window, match):
    s = _TreeSetup()
    assert s.backend.init_forward_metadata(s.decode).tree_decode is not None  # the path under test
    _refused_with_allocator(s, match, AttentionLayer(0, H, KVH, D, sliding_window=window), batch_tokens=3)


# ---- 2. AttentionLayer(scaling=nan | inf) ------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", [math.nan, math.inf, -math.inf, "0.1", True, torch.tensor(0.1)])
def test_a_scaling_that_is_not_a_finite_number_is_a_config_error(scaling):
    with pytest.raises(ConfigError, match=r"scaling=.* must be a finite number"):
        AttentionLayer(1, 2, 2, 8, scaling=scaling)


def test_a_finite_scaling_is_kept_as_a_float():
    import numpy as np

    for given in (0.125, 1, np.float32(0.5)):
        layer = AttentionLayer(1, 2, 2, 8, scaling=given)
        assert type(layer.scaling) is float and layer.scaling == float(given)
    assert AttentionLayer(1, 2, 2, 8).scaling == 1 / math.sqrt(8)  # the default, as before


def test_a_window_past_int64_is_a_config_error():
    """A window of 2**63 or more had been accepted: the chunked CPU kernels then raised a bare RuntimeError after
    the K/V write (torch takes it as int64), the dense path ran the layer as full attention."""
    with pytest.raises(ConfigError, match=r"sliding_window=9223372036854775808 must be below 2\*\*63"):
        AttentionLayer(1, 2, 2, 8, sliding_window=2 ** 63)
    assert AttentionLayer(1, 2, 2, 8, sliding_window=2 ** 63 - 1).window == 2 ** 63 - 1


# ---- 3. typed errors from the public constructors and functions -------------------------------------------------
@pytest.mark.parametrize("device, match", [
    ("gpu0", r"device='gpu0' is not a torch device"),
    pytest.param("cuda", r"device='cuda': torch.cuda.is_available\(\) is False", marks=NO_CUDA),
])
def test_req_to_token_pool_and_allocators_check_their_device(device, match):
    with pytest.raises(DeviceError, match=match):
        ReqToTokenPool(4, 8, device)
    with pytest.raises(DeviceError, match=match):
        hwkv.allocator.PagedTokenToKVPoolAllocator(64, 4, device)
    h = Hybrid()
    h.refused(lambda: SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, 1, device, h.pool), DeviceError, match)


@pytest.mark.parametrize("size, ctx", [("4", 8), (1.5, 8), (4, "8"), (4, 8.0), (True, 8), (None, 8)])
def test_req_to_token_pool_sizes_must_be_integers(size, ctx):
    with pytest.raises(ConfigError, match=rf"size={size!r} and max_context_len={ctx!r} must be integers >= 1"):
        ReqToTokenPool(size, ctx, "cpu")


def test_an_allocator_on_another_device_than_its_pool_is_refused_before_it_registers_its_table():
    """A 'meta' allocator over a CPU pool had replaced the pool's full_to_swa_index_mapping with a meta tensor."""
    h = Hybrid()
    mapping = h.pool.full_to_swa_index_mapping
    h.refused(lambda: SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, 1, "meta", h.pool), ConfigError,
              r"allocator device='meta' is not its pool's device cpu \(SWAKVPool\): build both on one device")
    assert h.pool.full_to_swa_index_mapping is mapping
    assert h.alloc.alloc(2).tolist() == [7, 8]  # the pool's own allocator still works


@pytest.mark.parametrize("window", ["8", 2.5, None, 0])
def test_release_out_of_window_reads_its_window_as_the_batch_version_does(window):
    s = CacheSetup()
    s.grow(16)
    row = s.rtt.req_to_token[s.row]
    if window in (None, 0):  # no window: nothing to release, the frontier comes back
        before = s.snapshot()
        assert release_out_of_window(s.a, row, 16, 0, window) == 0
        after = s.snapshot()
        assert same_snapshot(before[0], after[0]) and torch.equal(before[1], after[1])
        return
    match = rf"window={window!r} must be an integer \(the model's sliding_window W; None or 0: no window\)"
    s.unchanged(lambda: release_out_of_window(s.a, row, 16, s.frontier, window), ConfigError, match)
    s.unchanged(lambda: release_out_of_window_batch(s.a, s.rtt.req_to_token, t([s.row]), t([16]), t([s.frontier]),
                                                    window), ConfigError, match)


@pytest.mark.parametrize("sinks", [[0.0, 0.0], (0.0, 0.0), 0.0])
def test_sinks_that_are_not_a_tensor_are_a_config_error(sinks):
    with pytest.raises(ConfigError, match=rf"sinks must be a torch.Tensor of shape \(2,\) \(one per query head\), "
                                          rf"got {type(sinks).__name__}"):
        AttentionLayer(0, 2, 2, 8, sinks=sinks)


# ---- 4. docs/bad-inputs.md row 54: an insert of locs that are not live ------------------------------------------
def test_inserting_freed_locs_names_them_as_not_live_not_as_a_double_free():
    """Row 54: an insert shares pages, it frees nothing: freed locs are NotAllocatedError naming the loc, not the
    DoubleFreeError a second free gets."""
    s = CacheSetup()
    freed = s.a.alloc(4)
    s.a.free(freed)
    first = int(freed[0])
    s.unchanged(lambda: s.c.insert(list(range(200, 204)), freed, 0), NotAllocatedError,
                rf"^loc {first} \(full page {first // 4}\) is not live \(already free\): only a page that is held "
                r"can be shared")


def test_inserting_never_allocated_locs_names_them_as_not_live():
    s = CacheSetup()
    s.unchanged(lambda: s.c.insert(list(range(200, 204)), t([60, 61, 62, 63]), 0), NotAllocatedError,
                r"^loc 60 \(full page 15\) is not live \(never allocated\): only a page that is held can be shared")


@pytest.mark.parametrize("frontier, seq_len, bad", [("4", 16, "frontier '4'"), (4, 16.0, "seq_len 16.0"),
                                                    (None, 16, "frontier None")])
def test_release_out_of_window_refuses_a_frontier_or_length_that_is_no_integer(frontier, seq_len, bad):
    s = CacheSetup()
    s.grow(16)
    s.unchanged(lambda: release_out_of_window(s.a, s.rtt.req_to_token[s.row], seq_len, frontier, W),
                hwkv.errors.LocError, rf"^{bad} must be an integer$")


def test_check_share_of_freed_locs_is_the_not_live_refusal_the_cache_raises():
    """The prefix cache checks an insert or acquire through check_share: freed locs are named as not live there.
    `share` itself keeps the free's DoubleFreeError (tests/test_allocator.py pins it)."""
    from test_allocator_refusals import hybrid, unchanged

    a = hybrid()
    freed = a.alloc(4)
    a.free(freed)
    first = int(freed[0])
    for with_swa in (True, False):
        unchanged(a, lambda: a.check_share(freed, with_swa), NotAllocatedError,
                  rf"^loc {first} \(full page {first // 4}\) is not live \(already free\)")
    unchanged(a, lambda: a.share(freed), hwkv.errors.DoubleFreeError, "already free")



@pytest.mark.parametrize("row", [True, torch.tensor(True), 1.0])
def test_req_to_token_rows_refuse_bools_as_the_other_integer_checks_do(row):
    """`True` had been request row 1 (operator.index takes bools); every other integer check refuses them."""
    from hwkv.errors import LocError

    rtt = ReqToTokenPool(4, 8, "cpu")
    held = rtt.alloc(2)
    before = (rtt.available_size(), rtt.req_to_token.clone())
    with pytest.raises(LocError, match="request rows? must be an integer"):
        rtt.free(row)
    with pytest.raises(LocError, match="request row must be an integer"):
        rtt.free([0, row])
    assert (rtt.available_size(), rtt.req_to_token.tolist()) == (before[0], before[1].tolist()) and held == [0, 1]
