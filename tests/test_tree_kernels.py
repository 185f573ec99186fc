"""Tree verify (speculative top-k > 1) in both extend kernel sets, against hwkv.reference with the
visibility of hwkv.spec.tree_visible, on tiny shapes.

hwkv_cpu.kernels runs as is; hwkv_cuda.kernels runs under TRITON_INTERPRET=1 without a GPU (compiled
on one). Each batch mixes prefix lengths and tree shapes (chains, top-2/top-3 trees, a forest, a
single token, a request without drafts) over random non-contiguous or page-structured slots.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from hwkv import reference  # noqa: E402
from hwkv.checks import values_checkable  # noqa: E402
from hwkv.errors import ShapeError  # noqa: E402
from hwkv.ops import quantize  # noqa: E402
from hwkv.spec import DraftTree, TreeMask, build_tree_mask, tree_visible  # noqa: E402
from hwkv.window import first_visible  # noqa: E402

CHAIN4 = [-1, 0, 1, 2]
CHAIN6 = [-1, 0, 1, 2, 3, 4]
TOP2 = [-1, 0, 0, 1, 1, 2, 2]                   # depth 2, two children per node
TOP3 = [-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4]       # three wide, depth 3 (token 10), more tokens than a tile's rows
FOREST = [-1, -1, 0, 1, 2]                      # two roots
SINGLE = [-1]
FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None),) if d]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


class Kernels:
    """One kernel set: its module, its device, and (CPU) chunks of a few keys and query blocks of a few
    rows, so that every test crosses chunk and block borders."""

    def __init__(self, name, monkeypatch):
        self.name = name
        if name == "triton":
            pytest.importorskip("triton")
            from hwkv_cuda import kernels
            self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            from hwkv_cpu import kernels, kernels_extend
            monkeypatch.setattr(kernels_extend.extend_torch, "__defaults__", (4, 12))
            self.extend_module = kernels_extend
            self.dev = torch.device("cpu")
        self.mod = kernels


@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.cpu),
                        pytest.param("triton", marks=pytest.mark.interpret)])
def ks(request, monkeypatch):
    return Kernels(request.param, monkeypatch)


def _indptr(lens, dev):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)


class TreeCase:
    """Request b: prefix_lens[b] cached tokens, then the draft tree parents[b] (its tokens at list
    positions prefix .. prefix + n - 1), K/V at scattered slots (page > 1: whole pages) of a larger pool.
    window_list: the list starts at first_visible(q_pos0, W) (kv_pos0 > 0), else at 0."""

    def __init__(self, ks, prefix_lens, parents, h=4, kvh=2, d=16, dv=None, dtype=torch.float32, window=None,
                 window_list=True, seed=0, page=1, kv_dtype=None, k_scale=None, v_scale=None):
        g = torch.Generator().manual_seed(seed)
        dev, dv = ks.dev, dv or d
        self.ks, self.window, self.h, self.dv, self.dtype = ks, window, h, dv, dtype
        self.prefix, self.parents = list(prefix_lens), [list(p) for p in parents]
        self.ns = [len(p) for p in parents]
        seq = [a + n for a, n in zip(self.prefix, self.ns)]
        size = 2 * sum(seq) + 7
        if page == 1:
            self.slots = list(torch.split(torch.randperm(size - 1, generator=g)[:sum(seq)] + 1, seq))
        else:   # request r's token j at page_r[j // page] * page + j % page
            pages = torch.randperm((size - 1) // page, generator=g) + 1
            size, at, self.slots = (int(pages.max()) + 1) * page, 0, []
            for n in seq:
                own = pages[at:at + -(-n // page)]
                at += len(own)
                self.slots.append((own[:, None] * page + torch.arange(page)).reshape(-1)[:n])
        kv_dtype = kv_dtype or dtype
        self.k_scale, self.v_scale = k_scale, v_scale
        self.k_buf = quantize(torch.randn(size, kvh, d, generator=g), kv_dtype, k_scale).to(dev)
        self.v_buf = quantize(torch.randn(size, kvh, dv, generator=g), kv_dtype, v_scale).to(dev)
        k_deq = self.k_buf.float().cpu() * (k_scale or 1.0)   # what the pool holds: the kernels' exact target
        v_deq = self.v_buf.float().cpu() * (v_scale or 1.0)
        self.keys = [k_deq[s] for s in self.slots]
        self.values = [v_deq[s] for s in self.slots]
        self.pos0 = [first_visible(p, window) if window_list else 0 for p in self.prefix]
        lists = [s[p:] for s, p in zip(self.slots, self.pos0)]
        self.kv_indptr = _indptr([len(x) for x in lists], dev)
        self.kv_indices = torch.cat(lists + [torch.zeros(5, dtype=torch.int64)]).to(dev)   # unspecified tail
        self.kv_pos0 = torch.tensor(self.pos0, dtype=torch.int64, device=dev)
        self.qo_indptr = _indptr(self.ns, dev)
        self.q_pos0 = torch.tensor(self.prefix, dtype=torch.int64, device=dev)
        self.q = torch.randn(sum(self.ns), h, d, generator=g).to(dtype).to(dev)
        self.scaling = 1.0 / math.sqrt(d)
        draft = DraftTree.from_parents(self.parents, device=dev)
        ext = torch.tensor(self.ns, dtype=torch.int64, device=dev)
        self.tree = build_tree_mask(draft, ext, self.qo_indptr, self.q_pos0, int(draft.mask.shape[0]), sum(self.ns))
        self.blocks = [DraftTree.from_parents([p]).mask.view(len(p), len(p)) for p in self.parents]

    def ref(self, logit_cap=0.0, sinks=None, q=None):
        q = (self.q if q is None else q).float().cpu()
        outs, at = [torch.zeros(0, self.h, self.dv)], 0
        for pre, n, blk, k, v in zip(self.prefix, self.ns, self.blocks, self.keys, self.values):
            if n:
                see, q_pos = tree_visible(pre, blk, self.window)
                outs.append(reference.attention(q[at:at + n], k, v, q_pos, torch.arange(pre + n), self.scaling,
                                                None, logit_cap, None if sinks is None else sinks.cpu(), mask=see))
            at += n
        return torch.cat(outs)

    def args(self, out, logit_cap=0.0, sinks=None):
        return (self.q, self.k_buf, self.v_buf, self.kv_indptr, self.kv_indices, self.kv_pos0, self.qo_indptr,
                self.q_pos0, out, max(self.ns), self.scaling, self.window, logit_cap, sinks, self.k_scale,
                self.v_scale)

    def new_out(self):
        return torch.full((self.q.shape[0], self.h, self.dv), float("nan"), dtype=self.dtype, device=self.ks.dev)

    def extend(self, logit_cap=0.0, sinks=None, tree=True):
        out = self.new_out()
        self.ks.mod.extend_attention(*self.args(out, logit_cap, sinks), tree=self.tree if tree else None)
        return out


def _tol(ks, pool_dtype=torch.float32, out_dtype=torch.float32):
    """Output rounding, or the error of bf16 scores where the CPU kernels compute in bf16 (AMX)."""
    tol = TOL[out_dtype]
    if ks.name == "cpu":
        from hwkv_cpu import amx
        if amx.compute_dtype(pool_dtype) == torch.bfloat16:
            return max(tol, 4e-2)
    return tol


def _close(out, ref, tol=TOL[torch.float32]):
    assert not torch.isnan(out).any(), "output holds NaN (unwritten or 0/0)"
    err = (out.float().cpu() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol * max(1.0, ref.abs().max().item() if ref.numel() else 1.0), f"max abs error {err} > {tol}"


def _sinks(h, dev, seed=1):
    return (torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2).float().to(dev)


# --------------------------------------------------------------------------- against the reference
@pytest.mark.parametrize("window,window_list,page", [(None, True, 1), (1, True, 1), (3, True, 1), (3, False, 1),
                                                     (5, True, 4), (100, True, 1)])
def test_tree_matches_reference(ks, monkeypatch, window, window_list, page):
    if ks.name == "cpu" and window_list is False:   # keys streamed per chunk rather than gathered once
        monkeypatch.setattr(ks.extend_module, "RESIDENT_BYTES", 0)
    c = TreeCase(ks, [0, 5, 23, 40, 9, 3], [TOP2, CHAIN6, SINGLE, TOP3, FOREST, []], window=window,
                 window_list=window_list, page=page, seed=(window or 0) + page)
    _close(c.extend(), c.ref())


@pytest.mark.parametrize("h,kvh,dtype", [(6, 2, torch.float32), (6, 2, torch.bfloat16), (8, 1, torch.float32),
                                         (2, 2, torch.float32)])
def test_tree_sinks_softcap_gqa_dv(ks, h, kvh, dtype):
    """Groups of 3 (not a power of two: padded rows), 8 (a tile of two tokens) and 1; Dv != D."""
    c = TreeCase(ks, [17, 2, 30], [TOP3, TOP2, CHAIN4], h=h, kvh=kvh, d=16, dv=24, dtype=dtype, window=4, seed=h)
    sinks = _sinks(h, ks.dev)
    _close(c.extend(logit_cap=2.0, sinks=sinks), c.ref(2.0, sinks), _tol(ks, dtype, dtype))


def test_tree_reads_fp8_with_scales(ks):
    if not FP8:
        pytest.skip("this torch has no float8 dtypes")
    c = TreeCase(ks, [21, 6], [TOP2, FOREST], window=3, kv_dtype=FP8[0], k_scale=0.25, v_scale=0.5, seed=40)
    _close(c.extend(), c.ref(), _tol(ks, FP8[0]))


@pytest.mark.parametrize("window,want", [(None, [2.0, 2.5, 2.5, 3.0, 3.5]), (3, [3.0, 4.0, 4.0, 5.0, 6.0]),
                                         (2, [3.5, 4.5, 4.5, 5.5, 6.5]), (1, [4.0, 5.0, 5.0, 6.0, 7.0])])
def test_tree_hand_computed(ks, window, want):
    """Prefix of 4 (positions 0..3), drafts d0 (root, position 4), d1 and d2 (children of d0, 5), d3 (child
    of d2, 6), d4 (child of d3, 7). Each key's value is its position and q = 0, so each output is the mean
    of its visible keys' positions. No window: d0 sees 0..4 (2), d1 0..4 + d1 (2.5), d2 likewise, d3 0..4 +
    d2 + d3 (3), d4 0..4 + d2 + d3 + d4 (3.5). W = 3: d0 sees 2, 3, 4; d1 3, d0, d1; d3 d0, d2, d3; d4 d2,
    d3, d4. W = 2: d4 sees d3 and itself only, although d2 sits at list position 6 (its position is 5).
    W = 1: each sees itself."""
    c = TreeCase(ks, [4], [[-1, 0, 0, 2, 3]], h=2, kvh=1, window=window, seed=50)
    positions = [0, 1, 2, 3, 4, 5, 5, 6, 7]
    v = torch.zeros_like(c.v_buf)
    for slot, pos in zip(c.slots[0].tolist(), positions):
        v[slot] = float(pos)
    c.v_buf, c.k_buf, c.q = v, torch.zeros_like(c.k_buf), torch.zeros_like(c.q)
    out = c.extend().float().cpu()
    assert torch.allclose(out, torch.tensor(want)[:, None, None].expand_as(out), atol=1e-5)


# --------------------------------------------------------------------------- agreement with other paths
@pytest.mark.parametrize("window", [None, 3])
def test_chain_tree_is_plain_causal_verify(ks, window):
    c = TreeCase(ks, [7, 30, 2, 0], [CHAIN4, CHAIN6, SINGLE, CHAIN6], window=window, seed=60 + (window or 0))
    sinks = _sinks(4, ks.dev)
    tree, plain = c.extend(1.5, sinks), c.extend(1.5, sinks, tree=False)
    assert torch.allclose(tree, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_each_draft_agrees_with_decode_over_its_ancestor_path(ks, window):
    """Draft i at depth d sees the prefix and its ancestors, which sit at positions q_pos0 .. q_pos0 + d:
    a decode of the query at q_pos0 + d over the list (prefix, root .. i) sees the same keys."""
    c = TreeCase(ks, [5, 19, 0], [TOP2, FOREST, TOP3], window=window, seed=70 + (window or 0))
    sinks = _sinks(4, ks.dev)
    ext = c.extend(2.0, sinks)
    lists, pos0, q_pos = [], [], []
    for pre, p0, par, slots in zip(c.prefix, c.pos0, c.parents, c.slots):
        for i in range(len(par)):
            path = [i]
            while par[path[-1]] >= 0:
                path.append(par[path[-1]])
            lists.append(torch.cat([slots[p0:pre], slots[pre + torch.tensor(path[::-1])]]))
            pos0.append(p0)
            q_pos.append(pre + len(path) - 1)
    i64 = dict(dtype=torch.int64, device=c.ks.dev)
    out = torch.full_like(ext, float("nan"))
    indptr, indices = _indptr([len(x) for x in lists], ks.dev), torch.cat(lists).to(ks.dev)
    ks.mod.decode_attention(c.q, c.k_buf, c.v_buf, indptr, indices, torch.tensor(pos0, **i64),
                            torch.tensor(q_pos, **i64), out, c.scaling, window, 2.0, sinks, None, None,
                            max_kv_len=max(len(x) for x in lists))
    assert torch.allclose(out, ext, atol=1e-5, rtol=1e-5)


def test_tree_decode_list_hand_computed():
    """Prefix slots 10..13 at positions 0-3, drafts 20..24 of the tree [-1, 0, 0, 1, 2] at 4, 5, 5, 6, 6:
    each token's own list is the prefix (its window of it), its ancestors by depth, then itself."""
    from hwkv.metadata import KVIndexList
    from hwkv.spec import tree_decode_list
    i64 = dict(dtype=torch.int64)
    par = [-1, 0, 0, 1, 2]
    draft = DraftTree.from_parents([par])
    ext, qo, q_pos0 = torch.tensor([5]), torch.tensor([0, 5], dtype=torch.int32), torch.tensor([4])
    tree = build_tree_mask(draft, ext, qo, q_pos0, 25, 5)
    slots = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24])
    full = KVIndexList(torch.tensor([0, 9], dtype=torch.int32), slots, torch.tensor([0]), None, 9)
    got = tree_decode_list(tree, full, qo, q_pos0, ext, 5, 9)
    pre = [10, 11, 12, 13]
    want = [pre + [20], pre + [20, 21], pre + [20, 22], pre + [20, 21, 23], pre + [20, 22, 24]]
    ptr = got.indptr.tolist()
    assert [got.indices[ptr[t]:ptr[t + 1]].tolist() for t in range(5)] == want
    assert got.pos0.tolist() == [0] * 5
    rtt = torch.zeros(3, 12, dtype=torch.int64)
    rtt[2, :9] = slots                    # the same full list read straight from the request's row
    via_rows = tree_decode_list(tree, full, qo, q_pos0, ext, 5, 9, rows=(rtt, torch.tensor([2])))
    ptr = via_rows.indptr.tolist()
    assert [via_rows.indices[ptr[t]:ptr[t + 1]].tolist() for t in range(5)] == want
    # W = 3: the request's window list starts at position 2 (slots 12, 13, then the drafts)
    win = KVIndexList(torch.tensor([0, 7], dtype=torch.int32), slots[2:], torch.tensor([2]), 3, 7)
    got = tree_decode_list(tree, win, qo, q_pos0, ext, 5, 3)
    ptr = got.indptr.tolist()
    assert [got.indices[ptr[t]:ptr[t + 1]].tolist() for t in range(5)] == [
        [12, 13, 20], [13, 20, 21], [13, 20, 22], [20, 21, 23], [20, 22, 24]]
    assert got.pos0.tolist() == [2, 3, 3, 4, 4]
    assert tree.q_positions.tolist() == [4, 5, 5, 6, 6]
    # a chain deeper than the window: W = 3 over prefix 10, 11 (positions 0-1) and drafts 20..24 (2-6)
    chain = build_tree_mask(DraftTree.from_parents([[-1, 0, 1, 2, 3]]), ext, qo, torch.tensor([2]), 25, 5)
    lst = KVIndexList(torch.tensor([0, 7], dtype=torch.int32), torch.tensor([10, 11, 20, 21, 22, 23, 24]),
                      torch.tensor([0]), 3, 7)
    got = tree_decode_list(chain, lst, qo, torch.tensor([2]), ext, 5, 3)
    ptr = got.indptr.tolist()
    assert [got.indices[ptr[t]:ptr[t + 1]].tolist() for t in range(5)] == [
        [10, 11, 20], [11, 20, 21], [20, 21, 22], [21, 22, 23], [22, 23, 24]]
    assert got.pos0.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(slots, torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24], **i64)), "input list unchanged"


@pytest.mark.parametrize("window,window_list", [(None, True), (3, True), (3, False), (7, True)])
def test_tree_decode_lists_through_the_decode_kernel_equal_the_tree_extend(ks, window, window_list):
    """tree_verify="decode": the decode kernel over tree_decode_list's per-token lists gives what the tree
    extend kernel gives (and the reference), for mixed trees, a forest, a request without drafts."""
    from hwkv.metadata import KVIndexList
    from hwkv.spec import tree_decode_list
    c = TreeCase(ks, [5, 19, 0, 8, 2], [TOP2, FOREST, TOP3, SINGLE, CHAIN6], window=window, window_list=window_list,
                 seed=90 + (window or 0))
    sinks = _sinks(4, ks.dev)
    lens = (c.kv_indptr[1:] - c.kv_indptr[:-1]).tolist()
    lst = KVIndexList(c.kv_indptr, c.kv_indices, c.kv_pos0, window if window_list else None, max(lens))
    ext = torch.tensor(c.ns, dtype=torch.int64, device=ks.dev)
    cap = min(max(lens), window) if (window and window_list) else max(lens)
    rows = tree_decode_list(c.tree, lst, c.qo_indptr, c.q_pos0, ext, sum(c.ns), cap)
    out = c.new_out()
    ks.mod.decode_attention(c.q, c.k_buf, c.v_buf, rows.indptr, rows.indices, rows.pos0, c.tree.q_positions, out,
                            c.scaling, window, 2.0, sinks, None, None, max_kv_len=rows.max_len)
    _close(out, c.ref(2.0, sinks), _tol(ks))
    assert torch.allclose(out, c.extend(2.0, sinks), atol=1e-5, rtol=1e-5)


def test_inputs_unchanged(ks):
    c = TreeCase(ks, [11, 3], [TOP2, CHAIN4], window=3, seed=80)
    before = [t.clone() for t in (c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, *c.tree)]
    c.extend(sinks=_sinks(4, ks.dev))
    after = (c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, *c.tree)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# --------------------------------------------------------------------------- bad trees
def _bad_trees(c):
    """(tree, message): wrong dtypes, shapes and devices (always checked), then wrong values (checked where
    that costs no device sync: CPU tensors, or debug mode)."""
    m, ptr, pos = c.tree
    meta = torch.device("meta")
    values = [
        (TreeMask(m, ptr.clone().fill_(0), pos), "request 0 0 mask entries; its 7 draft tokens need 49"),
        (TreeMask(m[:-1], ptr, pos), r"tree.mask_indptr spans \[0, 65\), past tree.mask's 64 entries"),
        (TreeMask(m, ptr, pos + 3), r"tree.q_positions\[\d+\] = \d+ lies outside request \d's draft positions"),
    ]
    return ([
        (TreeMask(m.to(torch.int64), ptr, pos), "tree.mask must be a torch.bool"),
        (TreeMask(m.view(1, -1), ptr, pos), r"tree.mask has shape \[1, \d+\], expected \[\*\]"),
        (TreeMask(m, ptr.to(torch.int32), pos), "tree.mask_indptr must be a torch.int64"),
        (TreeMask(m, ptr[:-1], pos), r"tree.mask_indptr has shape \[2\], expected \[3\]"),
        (TreeMask(m, ptr, pos[:-1]), r"tree.q_positions has shape \[10\], expected \[11\]"),
        (TreeMask(m.to(meta), ptr, pos), "tree.mask is on meta"),
        (tuple(c.tree), "tree must be a hwkv.spec.TreeMask"),
    ] + (values if values_checkable(ptr) else []))


@pytest.mark.parametrize("debug", ["0", "1"])
def test_bad_trees_raise_shape_errors(ks, monkeypatch, debug):
    monkeypatch.setenv("HWKV_DEBUG", debug)   # debug: value checks on accelerators too
    c = TreeCase(ks, [6, 2], [TOP2, CHAIN4], window=3, seed=90)
    for bad, msg in _bad_trees(c):
        out = c.new_out()
        with pytest.raises(ShapeError, match=msg):
            ks.mod.extend_attention(*c.args(out), tree=bad)
        assert torch.isnan(out).all(), "a refused call wrote its output"


# --------------------------------------------------------------------------- Triton: plans and custom ops
@pytest.mark.interpret
def test_planned_path_records_the_tree(monkeypatch):
    ks = Kernels("triton", monkeypatch)
    k = ks.mod
    c = TreeCase(ks, [13, 4], [TOP3, FOREST], window=5, seed=100)
    plain = c.extend(tree=False)
    for has_tree in (True, False):
        out = c.new_out()
        # the list's window picks the tile config: plan with it, so the planned call is bitwise the plain one
        plan = k.plan_extend(*c.args(out)[:10], None, tree=c.tree if has_tree else None, window=c.window)
        assert plan.has_tree is has_tree and plan.consts["HAS_TREE"] is has_tree
        for tree in (c.tree, None):   # the other kind of call falls back to the checked entry point
            out = c.new_out()
            k.extend_attention_planned(plan, *c.args(out), tree=tree)
            if tree is None:
                assert torch.equal(out, plain)
            else:
                _close(out, c.ref())


@pytest.mark.interpret
def test_custom_op_takes_the_tree_and_compiles(monkeypatch):
    ks = Kernels("triton", monkeypatch)
    from hwkv_cuda.kernels import torch_ops  # noqa: F401  (registers torch.ops.hwkv.*)
    c = TreeCase(ks, [9, 1], [TOP2, CHAIN4], window=3, seed=110)

    def layer(*tree):
        out = c.new_out()
        torch.ops.hwkv.extend_attention(*c.args(out), *tree)
        return out * 1.0

    _close(layer(*c.tree), c.ref())
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")   # raises on any graph break
    _close(compiled(*c.tree), c.ref())
    with pytest.raises(ShapeError, match="together"):
        layer(c.tree.mask, c.tree.mask_indptr)


def _recording_verify_harness(backend_cls, tree_verify, buckets, monkeypatch):
    """A 2-layer hybrid harness (verify graphs of 5 drafts for `buckets`, if any) whose backend records each
    forward_decode / forward_extend call as (name, query rows); two requests prefilled."""
    from hwkv.batch import ForwardMode
    from hwkv.graph import EagerAdapter
    from hwkv.testing.harness import Harness, ModelGeometry
    geom = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(backend_cls, "cpu", geom, size=256, size_swa=64, tree_verify=tree_verify)
    if buckets:
        h.enable_graphs(buckets, EagerAdapter(), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=5, tree=True)
    calls = []
    for name in ("forward_decode", "forward_extend"):
        inner = getattr(h.backend, name)
        monkeypatch.setattr(h.backend, name, lambda q, *a, __f=inner, __n=name: (calls.append((__n, q.shape[0])),
                                                                                 __f(q, *a))[1])
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 3], ForwardMode.EXTEND)
    calls.clear()
    return h, rids, calls


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_decode_like_tree_verify_runs_the_decode_kernels(graph, monkeypatch):
    """tree_verify="decode": a tree verify's layers call forward_decode with one query per draft token and
    never forward_extend; an eager verify without a tree keeps the extend kernels; a bad value is a ConfigError."""
    from hwkv.batch import ForwardMode
    from hwkv.errors import ConfigError
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv.testing.spec_harness import tree_verify
    from hwkv_cpu.backend import TorchCPUBackend

    with pytest.raises(ConfigError, match="tree_verify='both' must be 'extend', 'decode' or 'auto'"):
        Harness(TorchCPUBackend, "cpu", ModelGeometry(), size=256, size_swa=64, tree_verify="both")
    h, rids, calls = _recording_verify_harness(TorchCPUBackend, "decode", [2] if graph else None, monkeypatch)
    tree_verify(h, rids, [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]], [[0, 2], [0, 1, 2]])   # checked inside
    assert calls and all(c == ("forward_decode", 10) for c in calls), calls
    if not graph:   # a verify without a tree keeps the extend kernels (graphs captured with tree=True run chains)
        calls.clear()
        h.forward(rids, [2, 2], ForwardMode.TARGET_VERIFY)
        assert calls and all(c[0] == "forward_extend" for c in calls), calls


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_auto_tree_verify_asks_the_backend_per_forward(graph, monkeypatch):
    """tree_verify="auto": each verify runs decode-like where the backend's decode_like_verify_pays says so for
    its batch (here: one request) and through the extend kernels otherwise, both matching the reference; in
    graph mode the captured bucket decides (the 1-bucket decode-like, the 2-bucket extend)."""
    from hwkv.testing.spec_harness import tree_verify
    from hwkv_cpu.backend import TorchCPUBackend

    asked = []

    class OneRequestPays(TorchCPUBackend):
        def decode_like_verify_pays(self, num_requests, num_tokens):
            asked.append((num_requests, num_tokens))
            return num_requests == 1

    h, rids, calls = _recording_verify_harness(OneRequestPays, "auto", [1, 2] if graph else None, monkeypatch)
    for batch_rids, kernel in ((rids, "forward_extend"), (rids[:1], "forward_decode"), (rids, "forward_extend")):
        calls.clear()
        asked.clear()
        tree_verify(h, batch_rids, [[-1, 0, 0, 1, 2]] * len(batch_rids), [[0, 1]] * len(batch_rids))
        assert calls and all(c == (kernel, 5 * len(batch_rids)) for c in calls), (kernel, calls)
        assert graph or asked == [(len(batch_rids), 5 * len(batch_rids))], asked
        h.check_integrity()


def test_auto_graph_lists_are_sized_by_the_first_decode_like_capture(monkeypatch):
    """"auto" keeps graph lists for its first decode-like capture only (not max_num_tokens as "decode" does); a
    later, larger decode-like capture is a CapacityError naming both sizes."""
    from hwkv.batch import ForwardMode
    from hwkv.errors import CapacityError
    from hwkv.graph import EagerAdapter
    from hwkv_cpu.backend import TorchCPUBackend

    class AlwaysPays(TorchCPUBackend):
        def decode_like_verify_pays(self, num_requests, num_tokens):
            return True

    h, rids, calls = _recording_verify_harness(AlwaysPays, "auto", None, monkeypatch)
    h.backend.init_graph_state(4, 20)
    h.enable_graphs([1], EagerAdapter(), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=5, tree=True)
    assert {b.pos0.shape[0] for b in h.backend.tree_planner._tree_decode_static.values()} == {5}, "sized for 1 x 5 drafts"
    with pytest.raises(CapacityError, match="10 draft tokens .* exceed the tree-decode buffers"):
        h.enable_graphs([2], EagerAdapter(), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=5, tree=True)


@pytest.mark.interpret
def test_triton_auto_verify_goes_decode_like_below_one_program_per_sm(monkeypatch):
    """TritonBackend's rule: decode-like while requests x kv heads of the full layers (their extend verify
    grid) < SMs; the SWA group's heads do not count."""
    pytest.importorskip("triton")
    from hwkv_cuda import backend as triton_backend
    from hwkv.testing.harness import Harness, ModelGeometry
    monkeypatch.setattr(triton_backend, "num_sms", lambda device: 132)
    geom = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=16, num_kv_heads=8, head_dim=16)
    h = Harness(triton_backend.TritonBackend, "cpu", geom, size=64, size_swa=32, tree_verify="auto")
    pays = h.backend.decode_like_verify_pays
    assert pays(1, 15) and pays(16, 240) and not pays(17, 255) and not pays(32, 480)
    h.pool.swa_kv_pool.head_num = 2     # a narrower SWA group changes nothing
    assert pays(16, 240) and not pays(17, 255)
    h.pool.full_kv_pool.head_num = 2
    assert pays(65, 975) and not pays(66, 990)


def test_check_tree_in_debug_mode_accepts_trees_and_names_what_is_not_one():
    """check_tree(debug=True) reads the mask: forests and deep trees pass; a missing diagonal, a bit above it,
    two ancestors at one depth, and an ancestor whose own ancestors are missing raise ShapeError."""
    from hwkv.spec import check_tree
    good = DraftTree.from_parents([TOP3, FOREST, SINGLE])
    assert check_tree(good, torch.tensor([11, 5, 1]), debug=True) == 121 + 25 + 1

    def one(rows):
        return DraftTree(torch.tensor(rows, dtype=torch.bool).reshape(-1)), torch.tensor([len(rows)])

    bad = [([[0, 0], [1, 1]], "diagonal set"),
           ([[1, 1], [0, 1]], "nothing above it"),
           ([[1, 0, 0], [0, 1, 0], [1, 1, 1]], "not one ancestor path"),    # two roots, both "ancestors" of 2
           ([[1, 0, 0], [1, 1, 0], [0, 1, 1]], "not one ancestor path")]    # 1's ancestor 0 missing from row 2
    for rows, msg in bad:
        tree, ext = one(rows)
        check_tree(tree, ext, debug=False)            # the length alone is right: no values read
        with pytest.raises(ShapeError, match=msg):
            check_tree(tree, ext, debug=True)
