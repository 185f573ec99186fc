"""Review 19, IPEX on CPU without IPEX: `load` faked to a stand-in whose paged decode computes what IPEX's does
(so the harness's reference checks hold), to count the block tables the backend builds per forward, and to see
what the wrappers hand the ops (IPEX's varlen op ignores strides: q must arrive contiguous)."""
import pytest
import torch

from hwkv.batch import ForwardMode
from hwkv.graph import EagerAdapter
from hwkv.metadata import KVIndexList
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario
from hwkv_cpu import ipex
from hwkv_cpu.backend import TorchCPUBackend
from hwkv_cpu.graph import CompileGraphAdapter

pytestmark = pytest.mark.ipex


class FakeIpex:
    """The three PagedAttention calls hwkv makes, in plain torch over the [S, KVH, 1, D] cache views, with IPEX's
    semantics as hwkv_cpu.ipex records them (decode: window_size W or -1, softcap after scaling)."""

    version = "fake"

    def __init__(self):
        self.decodes, self.extends, self.stores, self.queries = 0, 0, 0, []

    def single_query_cached_kv_attention(self, output, query, key_cache, value_cache, head_mapping, scale,
                                         block_tables, context_lens, block_size, max_context_len, alibi_slopes,
                                         window_size, k_scale, v_scale, softcap):
        assert block_size == 1 and block_tables.dtype == context_lens.dtype == torch.int32
        self.decodes += 1
        heads = head_mapping.long()
        for b in range(query.shape[0]):
            n = int(context_lens[b])
            slots = block_tables[b, :n].long()
            k = key_cache[slots, :, 0][:, heads].float()   # [n, H, D]
            v = value_cache[slots, :, 0][:, heads].float()
            s = torch.einsum("hd,nhd->hn", query[b].float(), k) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            if window_size > 0:
                s[:, :max(0, n - window_size)] = float("-inf")
            output[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v).to(output.dtype)

    def flash_attn_varlen_func(self, output, query, **kwargs):
        self.extends += 1
        self.queries.append(query)
        output.zero_()

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping, **kwargs):
        self.stores += 1
        self.queries.append((key, value))
        key_cache[slot_mapping.long(), :, 0] = key
        value_cache[slot_mapping.long(), :, 0] = value


@pytest.fixture
def fake_ipex(monkeypatch):
    fake = FakeIpex()
    monkeypatch.setattr(ipex, "load", lambda: (fake, ""))
    return fake


@pytest.fixture
def table_builds(monkeypatch):
    """The IPEX block tables built: one entry (the list's window) per plan_list call."""
    builds = []
    real = ipex.plan_list

    def counted(kv, *args, **kwargs):
        builds.append(kv.window)
        return real(kv, *args, **kwargs)

    monkeypatch.setattr(ipex, "plan_list", counted)
    return builds


def _decode_steps(h, steps=4):
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [9, 3, 14], ForwardMode.EXTEND)
    h.release()
    for _ in range(steps):
        h.forward(rids, [1, 1, 1], ForwardMode.DECODE)
        h.release()


GPT_OSS_LIKE = ModelGeometry(num_layers=4, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16,
                             sinks=True)


@pytest.mark.parametrize("why", ["sinks", "fp8-pool", "dv-differs"])
def test_no_ipex_table_is_built_when_no_layer_can_use_ipex(fake_ipex, table_builds, why):
    """Every layer refused by IPEX (sinks as in GPT-OSS, an fp8 pool, V head dim unlike K's): no forward builds a
    table, eager decode or extend with ipex_extend=True."""
    geom, dtype = GPT_OSS_LIKE, torch.float32
    if why == "fp8-pool":
        geom, dtype = ModelGeometry(num_layers=4, swa_every=2, window=4), torch.float8_e4m3fn
    elif why == "dv-differs":
        geom = ModelGeometry(num_layers=4, swa_every=2, window=4, v_head_dim=8)
    h = Harness(TorchCPUBackend, "cpu", geom, size=512, size_swa=64, dtype=dtype, ipex_extend=True)
    assert h.backend.ipex_reason is None
    _decode_steps(h)
    assert table_builds == [] and fake_ipex.decodes == 0


def test_ipex_tables_are_built_once_per_forward_and_list_read(fake_ipex, table_builds, monkeypatch):
    """Sinks on the SWA layers only: the full layers run IPEX (the stand-in, checked against the reference), and
    each decode forward builds the full list's table once for its two full layers, never the window list's."""
    geom = ModelGeometry(num_layers=4, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16, sinks=False,
                         swa_sinks=True)
    h = Harness(TorchCPUBackend, "cpu", geom, size=512, size_swa=64, dense_max_elements=0)
    forwards = []
    real = h.backend.init_forward_metadata
    monkeypatch.setattr(h.backend, "init_forward_metadata",
                        lambda batch: forwards.append(batch.forward_mode) or real(batch))
    _decode_steps(h, steps=5)
    decodes = sum(m == ForwardMode.DECODE for m in forwards)
    assert decodes == 5 and table_builds == [None] * decodes
    assert fake_ipex.decodes == 2 * decodes


@pytest.mark.parametrize("adapter", ["compile", "eager-adapter"])
@pytest.mark.parametrize("sinks", [True, False], ids=["all-refused", "full-layers-on-ipex"])
def test_graph_refills_build_only_the_tables_a_layer_reads(fake_ipex, table_builds, adapter, sinks):
    """Graph mode: a refill builds the static tables of the lists some IPEX layer read at capture, no others (none
    when every layer is refused); replays over batches that change stay exact (harness reference checks)."""
    geom = ModelGeometry(num_layers=4, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16, sinks=False,
                         swa_sinks=True) if not sinks else GPT_OSS_LIKE
    h = Harness(TorchCPUBackend, "cpu", geom, size=512, size_swa=96)
    h.enable_graphs([1, 2, 4], CompileGraphAdapter("eager") if adapter == "compile" else EagerAdapter())
    rids = [h.add_request() for _ in range(4)]
    h.forward(rids, [9, 3, 14, 6], ForwardMode.EXTEND)
    h.release()
    del table_builds[:]
    replays, decodes = h.runner.replays, fake_ipex.decodes
    for live in ([0, 1, 2, 3], [0, 1, 2], [1], [0, 2], [3]):
        h.forward([rids[i] for i in live], [1] * len(live), ForwardMode.DECODE)
        h.release()
    assert h.runner.replays == replays + 5
    if sinks:
        assert table_builds == [] and fake_ipex.decodes == decodes
    else:  # the full list's table, refilled once per replay; both full layers ran IPEX in every replay
        assert table_builds == [None] * 5 and fake_ipex.decodes == decodes + 2 * 5


def test_gemma_like_model_runs_every_layer_on_the_stand_in(fake_ipex, table_builds):
    """Nothing refused: both lists' tables, once per decode forward each; the reference checks hold."""
    geom = ModelGeometry(num_layers=4, swa_every=2, window=6, num_heads=8, num_kv_heads=2, head_dim=32,
                         logit_cap=30.0)
    h = Harness(TorchCPUBackend, "cpu", geom, size=1024, size_swa=128)
    run_scenario(h, steps=6, prompt_lens=(5, 9, 14), chunk=4)
    decodes = fake_ipex.decodes // 4
    assert decodes > 0 and sorted(table_builds, key=str) == sorted([None, 6] * decodes, key=str)


# ---- what the wrappers hand IPEX's ops ------------------------------------------------------------------------
def _one_list():
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    return KVIndexList(indptr, torch.tensor([4, 5, 6, 9, 10]), torch.zeros(2, dtype=torch.int64), None, 3)


def test_extend_hands_the_varlen_op_a_contiguous_query(fake_ipex):
    """A tokens-major view of a heads-major q (as the transformers integration passes it) reaches
    flash_attn_varlen_func contiguous, with the same values; a contiguous q goes as it is."""
    buf = torch.zeros(16, 2, 8)
    lst = ipex.plan_list(_one_list(), 3)
    qo = torch.tensor([0, 1, 3], dtype=torch.int32)
    heads_major = torch.randn(4, 3, 8)
    q = heads_major.transpose(0, 1)  # [T=3, H=4, D=8], strided
    assert not q.is_contiguous()
    ipex.extend(q, buf, buf, lst, qo, 2, torch.empty(3, 4, 8), 0.5, None, 0.0)
    got = fake_ipex.queries[-1]
    assert got.is_contiguous() and torch.equal(got, q)
    q2 = torch.randn(3, 4, 8)
    ipex.extend(q2, buf, buf, lst, qo, 2, torch.empty(3, 4, 8), 0.5, None, 0.0)
    assert fake_ipex.queries[-1].data_ptr() == q2.data_ptr()


def test_xpu_varlen_call_hands_a_contiguous_query(fake_ipex, monkeypatch):
    from hwkv_intel import ipex as intel

    monkeypatch.setattr(intel, "load", lambda: (fake_ipex, ""))
    buf = torch.zeros(16, 2, 1, 8)
    q = torch.randn(4, 3, 8).transpose(0, 1)
    intel.varlen(q, buf, buf, intel.plan_list(_one_list(), 3), torch.tensor([0, 1, 3], dtype=torch.int32), 2,
                 torch.empty(3, 4, 8), 0.5, None, 0.0)
    got = fake_ipex.queries[-1]
    assert got.is_contiguous() and torch.equal(got, q)


@pytest.mark.parametrize("layout", ["heads-major-view", "inner-strided", "contiguous"])
def test_store_hands_reshape_and_cache_rows_it_reads_right(fake_ipex, layout):
    """reshape_and_cache reads a token's heads through the key's first two strides and each head's D values as
    one run: k/v whose last dim is strided arrive contiguous; others as they are (no copy); the pool gets them."""
    k_buf, v_buf = torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)
    if layout == "heads-major-view":
        k, v = torch.randn(2, 3, 8).transpose(0, 1), torch.randn(2, 3, 8).transpose(0, 1)
    elif layout == "inner-strided":
        k, v = torch.randn(3, 2, 16)[:, :, ::2], torch.randn(3, 2, 16)[:, :, ::2]
    else:
        k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    loc = torch.tensor([3, 7, 11])
    ipex.store_kv_prechecked(k_buf, v_buf, loc, k, v)
    got_k, got_v = fake_ipex.queries[-1]
    assert fake_ipex.stores == 1
    assert got_k.stride(-1) == 1 and got_v.stride(-1) == 1
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    if layout != "inner-strided":
        assert got_k.data_ptr() == k.data_ptr() and got_v.data_ptr() == v.data_ptr()
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
