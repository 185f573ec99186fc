"""The CPU dense path's host-lean layouts: one request's plan (its slots, no row table) against the chunked
kernels, for decode and extend, windows, sinks, soft-cap and reduced-precision pools."""
import pytest
import torch

from test_cpu_kernels import FP8, Case, _dense, _tol  # noqa: E402


@pytest.mark.parametrize("window", [None, 1, 3, 9])
@pytest.mark.parametrize("window_list", [True, False])
@pytest.mark.parametrize("mode", ["decode", "extend", "prefill"])
def test_one_request_matches_chunked_kernels(window, window_list, mode):
    seq, ext = {"decode": (17, 1), "extend": (23, 6), "prefill": (12, 12)}[mode]
    case = Case([seq], [ext], h=6, kvh=2, d=8, dv=12, window=window, window_list=window_list, seed=11)
    dense_mode = "decode" if mode == "decode" else "extend"
    got = _dense(case, dense_mode, window)
    assert got is not None
    from hwkv_cpu.kernels_dense import plan_dense  # the plan holds the list's slots themselves

    plan = plan_dense(case.kv_indptr, case.kv_indices, case.kv_pos0, torch.tensor(case.q_pos0),
                      None if mode == "decode" else case.qo_indptr, int(case.kv_indptr[-1]), ext, window or 0, 2, 3,
                      8, 12)
    assert plan.rows.shape[0] == plan.keys
    want = case.decode(q=case.q[-1:]) if mode == "decode" else case.extend()
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_one_request_sinks_softcap_scales_reduced_out(mode):
    ext = 5 if mode == "extend" else 1
    for dtype in (torch.float32, torch.bfloat16, *FP8):
        case = Case([14], [ext], h=4, kvh=1, d=16, dv=8, dtype=dtype, window=5,
                    k_scale=0.5 if dtype in FP8 else None, v_scale=2.0 if dtype in FP8 else None, seed=12)
        sinks = torch.randn(4)
        for cap, s, out_dtype in ((0.0, sinks, None), (20.0, None, torch.bfloat16), (7.0, sinks, torch.float32)):
            got = _dense(case, mode, 5, cap, s, out_dtype)
            if mode == "decode":
                want = case.decode(cap, s, out_dtype, q=case.q[-1:])
            else:
                want = case.extend(cap, s, out_dtype)
            tol = max(_tol(dtype, got.dtype), 3e-5 if got.dtype == torch.float32 else 2e-2)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _decode_setup(bs=1, prompt=11, window=4, page=4):
    """A hybrid pool with requests of `prompt` tokens written (K/V random), then one decode step's batch."""
    import hwkv
    from hwkv.allocator import SWATokenToKVPoolAllocator
    from hwkv.batch import ForwardBatch, ForwardMode
    from hwkv.pool import SWAKVPool

    pool = SWAKVPool(128, 128, page, torch.float32, 2, 8, [0], [1], "cpu")
    alloc = SWATokenToKVPoolAllocator(128, 128, page, "cpu", pool)
    rtt = hwkv.ReqToTokenPool(size=bs + 1, max_context_len=64, device="cpu")
    backend = hwkv.make_backend(pool, rtt, sliding_window=window)
    rows = rtt.alloc(bs)
    g = torch.Generator().manual_seed(5)
    for i, row in enumerate(rows):
        n = prompt + (i % 2 if bs == 3 else 0)  # bs 3: lengths differ (the per-list build)
        loc = alloc.alloc_extend(prefix_lens=[0], seq_lens=[n + 1], last_loc=[-1], extend_num_tokens=n + 1)
        rtt.write(row, 0, loc)
        for gid in (0, 1):
            k = torch.randn(n + 1, 2, 8, generator=g)
            pool.get_key_buffer(gid)[loc if gid == 1 else pool.translate_loc_from_full_to_swa(loc)] = k
            pool.get_value_buffer(gid)[loc if gid == 1 else pool.translate_loc_from_full_to_swa(loc)] = -k
    lens = [int((rtt.req_to_token[r] > 0).sum()) for r in rows]
    last = torch.tensor([int(rtt.req_to_token[r, n - 1]) for r, n in zip(rows, lens)])
    batch = ForwardBatch(ForwardMode.DECODE, bs, torch.tensor(rows), torch.tensor(lens), last,
                         seq_lens_cpu=torch.tensor(lens))
    return pool, rtt, backend, batch


def _reference(pool, rtt, batch, layer, q):
    from hwkv import reference

    outs = []
    for b, (row, n) in enumerate(zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist())):
        locs = rtt.req_to_token[row, :n]
        if layer.window is not None:
            locs = pool.translate_loc_from_full_to_swa(locs[-layer.window:])
            keys = pool.get_key_buffer(layer.layer_id)[locs]
            vals = pool.get_value_buffer(layer.layer_id)[locs]
            keys = torch.cat([torch.zeros(n - keys.shape[0], 2, 8), keys])  # positions before the window: masked
            vals = torch.cat([torch.zeros(n - vals.shape[0], 2, 8), vals])
        else:
            keys, vals = pool.get_key_buffer(layer.layer_id)[locs], pool.get_value_buffer(layer.layer_id)[locs]
        outs.append(reference.batch_attention(q[b:b + 1], [keys], [vals], [n], [1], layer.scaling, layer.window,
                                              layer.logit_cap, layer.sinks))
    return torch.cat(outs)


@pytest.mark.parametrize("bs", [1, 3, 4])
def test_layer_constants_follow_the_layer_and_lists_match(bs):
    """A layer's kept dense constants are remade when its scaling, soft-cap or sinks change; equal-length batches
    (one table for every list) and mixed ones give the reference either way."""
    import hwkv

    pool, rtt, backend, batch = _decode_setup(bs)
    md = backend.init_forward_metadata(batch)
    for lst in (md.full, *md.windows.values()):  # the lists as the CSR fill builds them
        for b, (row, n) in enumerate(zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist())):
            got = lst.indices[int(lst.indptr[b]):int(lst.indptr[b + 1])]
            want = rtt.req_to_token[row, int(lst.pos0[b]):n]
            assert torch.equal(got, pool.translate_loc_from_full_to_swa(want) if lst.window else want)
    g = torch.Generator().manual_seed(9)
    for layer in (hwkv.AttentionLayer(1, 4, 2, 8, sinks=torch.randn(4, generator=g)),
                  hwkv.AttentionLayer(0, 4, 2, 8, sliding_window=4)):
        q = torch.randn(bs, 4, 8, generator=g)
        for change in (None, ("scaling", 0.7), ("logit_cap", 5.0), ("sinks", torch.randn(4, generator=g))):
            if change is not None:
                setattr(layer, *change)
            out = backend.forward(q, None, None, layer, batch, save_kv_cache=False)
            assert md.extra["dense_plans"], "the dense kernels ran the layer"
            torch.testing.assert_close(out, _reference(pool, rtt, batch, layer, q), atol=3e-5, rtol=3e-5)
