"""Review 19 of the CPU device package: a layer's sinks updated in place reach dense decode; the chunked kernels'
host plan is made once per forward and list (not in every layer); the sgl-kernel glue's slot table is the core's."""
import os
import traceback

import pytest
import torch

import hwkv
from hwkv import reference
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.graph import EagerAdapter
from hwkv.metadata import block_table_from_csr
from hwkv.pool import MHATokenToKVPool
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario
from hwkv_cpu import amx, kernels
from hwkv_cpu.backend import TorchCPUBackend
from hwkv_cpu.graph import CompileGraphAdapter
from test_cpu_kernels import small_chunks, threads  # noqa: E402,F401  (fixtures: small chunks, thread counts)

pytestmark = pytest.mark.cpu


# ---- finding 1: dense decode reads the sinks' current values ----------------------------------------------
class SinksSetup:
    """bs requests of n tokens each in a plain pool, one layer with sinks; decode (the dense path) and a one-token
    extend over the same last tokens, both without storing K/V."""

    def __init__(self, bs, n=6, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.pool = MHATokenToKVPool(64, 1, torch.float32, 2, 8, 1, "cpu")
        rtt = hwkv.ReqToTokenPool(size=4, max_context_len=32, device="cpu")
        self.backend = TorchCPUBackend(self.pool, rtt)
        rows = rtt.alloc(bs)
        self.locs = torch.arange(1, 1 + bs * n).view(bs, n)
        for r, l in zip(rows, self.locs):
            rtt.write(r, 0, l)
        self.pool.get_key_buffer(0)[1:1 + bs * n] = torch.randn(bs * n, 2, 8, generator=g)
        self.pool.get_value_buffer(0)[1:1 + bs * n] = torch.randn(bs * n, 2, 8, generator=g)
        self.bs, self.n = bs, n
        seq = torch.full((bs,), n)
        self.decode_batch = ForwardBatch(ForwardMode.DECODE, bs, torch.tensor(rows), seq, self.locs[:, -1].clone(),
                                         seq_lens_cpu=seq.clone())
        self.extend_batch = ForwardBatch(ForwardMode.EXTEND, bs, torch.tensor(rows), seq, self.locs[:, -1].clone(),
                                         extend_seq_lens=torch.ones(bs, dtype=torch.int64), seq_lens_cpu=seq.clone(),
                                         extend_seq_lens_cpu=torch.ones(bs, dtype=torch.int64))
        self.q = torch.randn(bs, 4, 8, generator=g)

    def run(self, layer, batch):
        self.backend.init_forward_metadata(batch)
        return self.backend.forward(self.q, None, None, layer, batch, save_kv_cache=False).clone()

    def ref(self, layer):
        k, v = self.pool.get_key_buffer(0), self.pool.get_value_buffer(0)
        return reference.batch_attention(self.q, [k[l] for l in self.locs], [v[l] for l in self.locs],
                                         [self.n] * self.bs, [1] * self.bs, layer.scaling, None, 0.0, layer.sinks)


def _sinks_layer(kind):
    if kind in ("parameter", "parameter.data"):  # the transformers integration keeps sinks.detach() of the model's
        # parameter; loaders write param (version counter shared with the detached sinks) or param.data (not shared)
        param = torch.nn.Parameter(torch.zeros(4))
        return hwkv.AttentionLayer(0, 4, 2, 8, sinks=param.detach()), param if kind == "parameter" else param.data
    if kind == "inference":  # made and updated under inference mode: no version counter to read
        with torch.inference_mode():
            sinks = torch.zeros(4)
        return hwkv.AttentionLayer(0, 4, 2, 8, sinks=sinks), sinks
    sinks = torch.zeros(4)
    return hwkv.AttentionLayer(0, 4, 2, 8, sinks=sinks), sinks


@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("kind", ["plain", "parameter", "parameter.data", "inference"])
def test_dense_decode_reads_sinks_updated_in_place(bs, kind):
    s = SinksSetup(bs)
    layer, owner = _sinks_layer(kind)
    first = s.run(layer, s.decode_batch)
    assert (first - s.ref(layer)).abs().max().item() < 1e-5
    for value in (5.0, -3.0):  # a weight load, then another (the cache must follow each)
        with torch.inference_mode() if kind == "inference" else torch.no_grad():
            owner.copy_(torch.full((4,), value))
        assert torch.equal(layer.sinks, torch.full((4,), value))
        decode = s.run(layer, s.decode_batch)
        extend = s.run(layer, s.extend_batch)
        assert (decode - s.ref(layer)).abs().max().item() < 1e-5, "decode used stale sinks"
        assert (decode - extend).abs().max().item() < 1e-5
    assert (decode - first).abs().max().item() > 1e-3


def test_dense_decode_keeps_one_sinks_column_per_batch_size():
    """The column is allocated once per layer and batch size and refilled in place (no allocation per forward)."""
    s = SinksSetup(3)
    layer, _ = _sinks_layer("plain")
    s.run(layer, s.decode_batch)
    cols = s.backend._kits[layer].cols
    kept = cols[3]
    for _ in range(2):
        s.run(layer, s.decode_batch)
    assert list(cols) == [3] and cols[3] is kept
    assert torch.equal(kept[0].view(3, 2, 2), layer.sinks.view(1, 2, 2).expand(3, 2, 2))


# ---- finding 5: the chunked kernels' host plan, once per forward and list -------------------------------------
GEOMETRIES = {
    "hybrid-gqa-sinks-cap": (ModelGeometry(num_layers=4, swa_every=2, window=5, num_heads=8, num_kv_heads=2,
                                           head_dim=16, logit_cap=2.0, sinks=True), 64),
    "plain-pool-window-mask": (ModelGeometry(num_layers=4, swa_every=2, window=3, num_heads=4, num_kv_heads=1,
                                             head_dim=8, swa_sinks=True), None),
    "dv-differs": (ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=6, num_kv_heads=3, head_dim=8,
                                 v_head_dim=12, logit_cap=30.0), 64),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_chunked_kernels_match_reference_with_the_per_forward_plan(small_chunks, threads, name):
    """The chunked kernels only (dense path off), every forward checked against hwkv.reference by the harness:
    prefill chunks, decode with churn (batches that change between forwards), windows, sinks, soft-cap, GQA."""
    geom, size_swa = GEOMETRIES[name]
    h = Harness(TorchCPUBackend, "cpu", geom, size=512, size_swa=size_swa, dense_max_elements=0, seed=3)
    run_scenario(h, steps=8, prompt_lens=(5, 23, 11, 2), chunk=7)
    assert h.max_err < 1e-4


def test_one_forward_serves_layers_of_different_windows_sinks_and_caps_from_one_plan(small_chunks, threads):
    """Kernel level: one forward's lists (one epoch) read by layers that differ in window, sinks and soft-cap:
    each layer's output is the reference's (a plan keyed without the window would mask wrongly)."""
    from hwkv_cpu import host_plan

    class Owner:  # what the epoch's plans live as long as (a backend)
        pass

    owner = Owner()
    epoch = host_plan.new_epoch(owner)
    host_plan.next_forward(epoch)
    g = torch.Generator().manual_seed(7)
    seq = [1, 19, 40, 7, 33]
    slots = torch.randperm(200, generator=g)[:sum(seq)] + 1
    per_req = list(torch.split(slots, seq))
    indptr = torch.tensor([0] + seq).cumsum(0).to(torch.int32)
    indices, pos0 = torch.cat(per_req), torch.zeros(len(seq), dtype=torch.int64)
    q_pos = torch.tensor(seq) - 1
    k_buf, v_buf = torch.randn(256, 2, 16, generator=g), torch.randn(256, 2, 16, generator=g)
    q = torch.randn(len(seq), 6, 16, generator=g)
    for window, cap, with_sinks in [(None, 0.0, False), (3, 0.0, False), (8, 2.0, True), (None, 30.0, True),
                                    (3, 0.0, False)]:
        sinks = torch.randn(6, generator=g) if with_sinks else None
        out = torch.full((len(seq), 6, 16), float("nan"))
        kernels.decode_attention(q, k_buf, v_buf, indptr, indices, pos0, q_pos, out, 0.25, window, cap, sinks, None,
                                 None, _own_lists=True, _epoch=epoch)
        want = reference.batch_attention(q, [k_buf[s] for s in per_req], [v_buf[s] for s in per_req], seq,
                                         [1] * len(seq), 0.25, window, cap, sinks)
        assert (out - want).abs().max().item() < 3e-5, (window, cap, with_sinks)


class ToListCounter:
    """Counts the CPU device package's Tensor.tolist calls (those with a hwkv_cpu frame on the stack: not the
    harness's or the reference's), in all and per layer call of the backend (through a wrapped backend.forward)."""

    def __init__(self, h, monkeypatch):
        self.calls, self.per_layer = 0, []
        real_tolist = torch.Tensor.tolist

        def tolist(t):
            if any(f"{os.sep}hwkv_cpu{os.sep}" in f.filename for f in traceback.extract_stack()):
                self.calls += 1
            return real_tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        real_forward = h.backend.forward

        def forward(q, k, v, layer, batch, save_kv_cache=True):
            before = self.calls
            out = real_forward(q, k, v, layer, batch, save_kv_cache)
            self.per_layer.append((layer.layer_id, self.calls - before))
            return out

        monkeypatch.setattr(h.backend, "forward", forward)


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_layers_after_the_first_reading_a_list_do_no_host_reads(mode, monkeypatch):
    """Layers 0 (SWA) and 1 (full) read the window list and the full list first; layers 2..5 read them again
    and must find this forward's host plan: no tolist at all in their calls (outside debug mode, whose reuses
    re-read the lists)."""
    monkeypatch.delenv("HWKV_DEBUG", raising=False)
    geom = ModelGeometry(num_layers=6, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=8, sinks=True)
    h = Harness(TorchCPUBackend, "cpu", geom, size=512, size_swa=64, dense_max_elements=0)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [9, 3, 14], ForwardMode.EXTEND)
    h.release()
    counter = ToListCounter(h, monkeypatch)
    if mode == "decode":
        h.forward(rids, [1, 1, 1], ForwardMode.DECODE)
    else:
        h.forward(rids, [5, 2, 3], ForwardMode.EXTEND)
    per_layer = dict(counter.per_layer)
    assert len(per_layer) == 6
    assert per_layer[0] > 0 and per_layer[1] > 0  # each list read on the host once
    assert [per_layer[i] for i in range(2, 6)] == [0, 0, 0, 0], counter.per_layer


@pytest.mark.parametrize("adapter", ["compile", "eager-adapter"])
def test_graph_replays_plan_once_per_replay_and_follow_batch_changes(small_chunks, adapter, monkeypatch):
    """CPU graphs run the chunked kernels: each replay reads each list on the host once (the refill steps the
    backend's forward counter, which keys the plan), and batches that grow, shrink and pad between replays stay
    exact (the harness checks every replay against the reference). Outside debug mode (its reuses re-read)."""
    monkeypatch.delenv("HWKV_DEBUG", raising=False)
    geom = ModelGeometry(num_layers=6, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=8,
                         logit_cap=3.0, sinks=True)
    h = Harness(TorchCPUBackend, "cpu", geom, size=512, size_swa=96)
    h.enable_graphs([1, 2, 4], CompileGraphAdapter("eager") if adapter == "compile" else EagerAdapter())
    rids = [h.add_request() for _ in range(4)]
    h.forward(rids, [9, 3, 14, 6], ForwardMode.EXTEND)
    h.release()
    counter = ToListCounter(h, monkeypatch)
    replays = h.runner.replays
    for live in ([0, 1, 2, 3], [0, 1, 2], [1], [0, 2], [0, 1, 2, 3], [3]):
        before = len(counter.per_layer), counter.calls
        h.forward([rids[i] for i in live], [1] * len(live), ForwardMode.DECODE)
        h.release()
        if adapter == "eager-adapter":  # the layers' Python runs as it is: each layer call seen
            calls = [n for _, n in counter.per_layer[before[0]:]]
            assert len(calls) == 6 and calls[0] > 0 and calls[1] > 0 and calls[2:] == [0, 0, 0, 0], calls
        else:  # compiled: the ops' host reads, per replay, at most what two layers (the two lists) do
            assert 0 < counter.calls - before[1] <= 2 * 3
    assert h.runner.replays == replays + 6


# ---- finding 6: the sgl-kernel glue's slot table is the core's block_table_from_csr ---------------------------
def test_sgl_glue_takes_the_cores_block_table(monkeypatch):
    from hwkv.testing.vendor_schemas.sgl_kernel import make_sgl_ops

    decode_op, extend_op = make_sgl_ops()
    tables = []
    real = block_table_from_csr

    def counted(*args):
        table = real(*args)
        tables.append(table)
        return table

    monkeypatch.setattr(amx, "block_table_from_csr", counted)
    monkeypatch.setattr(amx, "sgl_ops", lambda: (amx.SglOps(decode_op, extend_op), ""))
    assert not hasattr(amx, "_req_to_token")
    g = torch.Generator().manual_seed(5)
    lens = [5, 1, 12]
    k_buf = torch.randn(64, 2, 32, generator=g).bfloat16()
    v_buf = torch.randn(64, 2, 32, generator=g).bfloat16()
    slots = (torch.randperm(63, generator=g)[:sum(lens)] + 1)
    indptr = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q = torch.randn(3, 4, 32, generator=g).bfloat16()
    out = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    kernels.decode_attention(q, k_buf, v_buf, indptr, slots, torch.zeros(3, dtype=torch.int64),
                             torch.tensor(lens) - 1, out, None, None, 0.0, None, None, None)
    assert len(decode_op.calls) == 1 and len(tables) == 1
    table = tables[0]
    assert table.shape == (3, 12)
    for b, n in enumerate(lens):
        row = slots[int(indptr[b]): int(indptr[b + 1])]
        assert torch.equal(table[b, :n].long(), row) and not table[b, n:].any()
    per_req = list(torch.split(slots, lens))
    want = reference.batch_attention(q.float(), [k_buf[s].float() for s in per_req],
                                     [v_buf[s].float() for s in per_req], lens, [1, 1, 1], 32 ** -0.5)
    assert (out.float() - want).abs().max().item() < 4e-2


@pytest.mark.parametrize("debug", [False, True])
def test_a_list_rewritten_within_a_forward_is_caught_in_debug_mode(debug):
    """host_plan reuses a forward's host lists while the forward counter stands; the rule is that nothing rewrites
    a list within a forward. A counter made in debug mode re-reads the lists at each reuse and raises when one
    changed; without it the reuse is silent (the rule's cost is nothing per layer)."""
    from hwkv_cpu import host_plan

    class Owner:
        pass

    owner = Owner()
    epoch = host_plan.new_epoch(owner, debug=debug)
    host_plan.next_forward(epoch)
    indices = torch.arange(1, 9, device="cpu")
    first = host_plan.host_lists(epoch, (indices,))
    assert host_plan.host_lists(epoch, (indices,)) is first  # the same forward: kept
    indices.copy_(torch.arange(11, 19, device="cpu"))         # rewritten in place, same count
    if debug:
        with pytest.raises(AssertionError, match="changed after its metadata step"):
            host_plan.host_lists(epoch, (indices,))
    else:
        assert host_plan.host_lists(epoch, (indices,)) is first
    host_plan.next_forward(epoch)                             # the next forward reads it again
    assert host_plan.host_lists(epoch, (indices,)).lists == [list(range(11, 19))]
