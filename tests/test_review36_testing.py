"""Review 36 (the public test harness, hwkv/testing/): defects of the harness's own API, and broken backends the
contract suite (`hwkv verify`'s checks) passes.

Method for the second kind: one realistic fault per backend, a subclass of the reference backend, the contract suite
run on it through its public entry points (`hwkv.testing.verify.run_contract`, or the contract test that should catch
it). Caught already, no test here: a wrong second request of a batch, sinks ignored in decode only, the soft-cap
skipped in extend only, a wrong answer in graph replays only, the window one key wider at page size > 1 only, a tree
mask ignored for one draft position (extend verify), graph padding rows' K/V written over a live slot.
CPU tensors, tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

from hwkv.allocator import same_snapshot
from hwkv.batch import ForwardMode
from hwkv.errors import ConfigError, HwkvError, ReferenceMismatchError
from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget, contract
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.reference_backend import ReferenceBackend
from hwkv.testing.spec_harness import draft_steps, tree_verify
from hwkv.testing.verify import run_contract
from test_review35_contract import _contract_catches

pytestmark = pytest.mark.usefixtures("one_thread")


class _Faulty(ReferenceBackend):
    """The reference backend with a hook on each request's attention arguments (subclasses put one fault there)."""

    def fault(self, layer, md, q, k, v, q_pos, k_pos, mask, args):
        """Returns (q, k, v, q_pos, k_pos, mask, args): args = dict(window=, logit_cap=, sinks=, scaling=)."""
        return q, k, v, q_pos, k_pos, mask, args

    def request_attention(self, layer, md, q, k, v, q_pos, k_pos, mask, options):
        return super().request_attention(layer, md, *self.fault(layer, md, q, k, v, q_pos, k_pos, mask, options))

    def _attend(self, q, layer, kv, md, out):
        self.layer_hook(layer, kv, md)
        super()._attend(q, layer, kv, md, out)

    def layer_hook(self, layer, kv, md):
        """Per-layer work besides the attention (none here)."""

    forward_decode = _attend
    forward_extend = _attend


def _target(cls):
    return ContractTarget(cls.__name__, cls, "cpu", EagerAdapter)


# ---- 1. sizes and geometries the contract never checks -------------------------------------------------------
class _LosesAKeyPast128(_Faulty):
    """A request whose list holds more than 128 keys loses its oldest one (a fault at a second 128-key tile or a
    split-KV boundary)."""

    def fault(self, layer, md, q, k, v, q_pos, k_pos, mask, args):
        if k.shape[0] > 128:
            k, v, k_pos = k[1:], v[1:], k_pos[1:]
            mask = None if mask is None else mask[:, 1:]
        return q, k, v, q_pos, k_pos, mask, args


class _SecondQueryTileOffByOne(_Faulty):
    """A request's queries past its 64th in one forward (a second 128-row query tile at 2 q heads per KV head) get
    their causal bound one key short."""

    def fault(self, layer, md, q, k, v, q_pos, k_pos, mask, args):
        if q.shape[0] > 64 and mask is None:
            q_pos = q_pos.clone()
            q_pos[64:] -= 1
        return q, k, v, q_pos, k_pos, mask, args


class _WrongScaleAboveHeadDim64(_Faulty):
    """head_dim > 64 (D=128, D=256: their own kernel configs) takes D=64's softmax scale, 1/8."""

    def fault(self, layer, md, q, k, v, q_pos, k_pos, mask, args):
        if q.shape[-1] > 64 and abs(layer.scaling - q.shape[-1] ** -0.5) < 1e-9:
            args = dict(args, scaling=64 ** -0.5)
        return q, k, v, q_pos, k_pos, mask, args


class _PagedPathWithoutCapOrSinks(_Faulty):
    """Page size > 1 takes a paged kernel that has no soft-cap and no sinks (NPU/XPU pick their paths by page
    size); page size 1 is right."""

    def fault(self, layer, md, q, k, v, q_pos, k_pos, mask, args):
        if self.pool.page_size > 1:
            args = dict(args, logit_cap=0.0, sinks=None)
        return q, k, v, q_pos, k_pos, mask, args


_GAPS = (_LosesAKeyPast128, _SecondQueryTileOffByOne, _WrongScaleAboveHeadDim64, _PagedPathWithoutCapOrSinks)


@pytest.fixture(scope="module")
def eager_contract_results():
    """The contract suite's eager checks (`-k 'not graph'`, as `hwkv verify -k` runs them) over every _GAPS backend
    in one run: {backend name: [(check, outcome, message)]}."""
    code, results = run_contract([_target(c) for c in _GAPS], select="not graph")
    assert results, f"the contract suite ran nothing (pytest exit code {code})"
    by_target = {c.__name__: [] for c in _GAPS}
    for check, (outcome, msg) in results.items():
        name = check.split("[", 1)[1].split("-", 1)[0].rstrip("]")
        by_target[name].append((check, outcome, msg))
    return by_target


def _assert_some_check_fails(results, cls):
    rows = results[cls.__name__]
    assert rows, f"no contract check ran on {cls.__name__}"
    failed = [r for r in rows if r[1] == "failed"]
    assert failed, (f"GAP: all {len(rows)} eager contract checks passed {cls.__name__} ({cls.__doc__.split('(')[0]})")


def test_contract_passes_a_backend_wrong_only_past_128_keys(eager_contract_results):
    """Defect: no contract check reads more than 74 keys a request, so a backend wrong past a 128-key tile passes."""
    _assert_some_check_fails(eager_contract_results, _LosesAKeyPast128)


def test_contract_passes_a_backend_wrong_only_past_64_queries_of_a_request(eager_contract_results):
    """Defect: no contract forward extends a request by more than 14 tokens, so a second query tile is never run."""
    _assert_some_check_fails(eager_contract_results, _SecondQueryTileOffByOne)


def test_contract_passes_a_backend_wrong_only_at_head_dims_above_64(eager_contract_results):
    """Defect: the contract's head dims are 16 and 32 only, so D=128/256 (real models, own kernel configs) pass."""
    _assert_some_check_fails(eager_contract_results, _WrongScaleAboveHeadDim64)


def test_contract_passes_a_backend_ignoring_softcap_and_sinks_at_page_size_above_1(eager_contract_results):
    """Defect: sinks, soft-cap (and fp8 scales, scaling, W=1) are checked at page size 1 only."""
    _assert_some_check_fails(eager_contract_results, _PagedPathWithoutCapOrSinks)


# ---- 2. the speculative checks' tolerance ---------------------------------------------------------------------
class _HalfPrecisionTreeVerify(_Faulty):
    """The tree verify kernel (the extend kernels' masked path) computes q.k in fp16 on an fp32 cache: ~6e-4 off,
    the half-precision math `contract.FP32_TOLERANCE` (1e-4) is there to refuse."""

    def fault(self, layer, md, q, k, v, q_pos, k_pos, mask, args):
        if mask is not None:
            q, k = q.half().float(), k.half().float()
        return q, k, v, q_pos, k_pos, mask, args


def test_spec_contract_checks_use_the_fp32_tolerance():
    """Defect: contract_spec's harness keeps the default 2e-3 (not FP32_TOLERANCE/fp32_tolerance): fp16 math passes."""
    target = _target(_HalfPrecisionTreeVerify)
    h = Harness(target.backend_cls, "cpu", contract.GEOM, size=1024, size_swa=32, tolerance=contract.FP32_TOLERANCE)
    rid = h.add_request()
    h.forward([rid], [9])
    with pytest.raises(ReferenceMismatchError):   # the fault is past the fp32 contract's own limit
        tree_verify(h, [rid], [contract.TREE], [[0, 1, 3]])
    _contract_catches(contract.test_tree_verify_accept_and_reuse, target, 1, False, "extend")


# ---- 3. host reads the contract's count misses ----------------------------------------------------------------
class _TokenToRequestMapPerLayer(_Faulty):
    """Every layer rebuilds the token -> request map with `repeat_interleave` without `output_size`: the output's size
    is read from the device, one host sync per layer on an accelerator. Outputs are right."""

    def layer_hook(self, layer, kv, md):
        torch.repeat_interleave(torch.arange(md.batch_size, device=md.qo_indptr.device), md.qo_indptr.diff())


class _LiveEntriesByMaskPerLayer(_Faulty):
    """Every layer selects its list's live entries with a boolean mask (`indices[indices > 0]`): a data-dependent
    size, one host sync per layer on an accelerator. Outputs are right."""

    def layer_hook(self, layer, kv, md):
        kv.indices[kv.indices > 0]


@pytest.mark.parametrize("cls", [_TokenToRequestMapPerLayer, _LiveEntriesByMaskPerLayer],
                         ids=["repeat_interleave", "bool-mask"])
def test_layers_syncing_through_data_dependent_shapes_fail_the_host_read_check(cls):
    """Defect: HostReads counts nonzero/.item() but not the ops that sync for their output size (x[bool_mask],
    repeat_interleave without output_size, masked_select, unique): a per-layer sync passes the contract."""
    _contract_catches(contract.test_layers_read_the_device_no_more_with_more_layers, _target(cls), {})


# ---- 4. the Harness's own API ---------------------------------------------------------------------------------
class _SecondRequestOff(ReferenceBackend):
    """The second request of a batch is 1e-2 off the reference (a broken backend every default check catches)."""

    def _attend(self, q, layer, kv, md, out):
        super()._attend(q, layer, kv, md, out)
        if md.batch_size > 1:
            lo, hi = md.qo_indptr.tolist()[1:3]
            out[lo:hi] += 1e-2

    forward_decode = _attend
    forward_extend = _attend


def _two_forwards(h):
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 5])
    h.forward(rids, [1, 1])


def test_the_broken_backend_fails_a_default_harness():
    """(Control for the next test: with default options the harness catches _SecondRequestOff.)"""
    with pytest.raises(ReferenceMismatchError):
        _two_forwards(Harness(_SecondRequestOff, "cpu", ModelGeometry()))


@pytest.mark.parametrize("bad", [dict(tolerance=float("nan")), dict(tolerance="1e-3"), dict(check_queries=0),
                                 dict(check_queries=-1), dict(check_queries=1.5), dict(shadow_requests=-1)],
                         ids=["tol-nan", "tol-str", "queries-0", "queries-neg", "queries-float", "shadow-neg"])
def test_harness_check_options_are_validated(bad):
    """Defect: Harness validates seed only: a NaN tolerance, check_queries=0 or shadow_requests=-1 checks nothing
    (a broken backend passes); a str tolerance or check_queries=-1/1.5 end in a bare TypeError/RuntimeError/IndexError.
    Expected: ConfigError at construction (or, for a value it accepts, the broken backend caught)."""
    with pytest.raises((ConfigError, ReferenceMismatchError)):
        _two_forwards(Harness(_SecondRequestOff, "cpu", ModelGeometry(), **bad))


def test_harness_forward_atol_nan_does_not_disable_the_check():
    """Defect: Harness.forward(atol=nan) passes any output (err > nan is False): a broken backend passes."""
    h = Harness(_SecondRequestOff, "cpu", ModelGeometry())
    rids = [h.add_request() for _ in range(2)]
    with pytest.raises((ConfigError, ReferenceMismatchError)):
        h.forward(rids, [5, 5], atol=float("nan"))


def test_unknown_request_ids_are_a_typed_error():
    """Defect: Harness.forward/finish (and spec_harness.tree_verify) with an id never handed out: bare KeyError."""
    h = Harness(ReferenceBackend, "cpu", ModelGeometry())
    rid = h.add_request()
    with pytest.raises(HwkvError, match="7"):
        h.forward([7], [3])
    with pytest.raises(HwkvError, match="7"):
        tree_verify(h, [rid, 7], [[-1, 0], [-1, 0]], [[0], [0]])
    h.forward([rid], [3])
    h.finish(rid)
    with pytest.raises(HwkvError, match=str(rid)):
        h.finish(rid)   # finished already


def test_a_repeated_request_id_is_refused_before_anything_is_allocated():
    """Defect: Harness.forward([r, r], ...) allocates both, leaks one's slots and blames the backend (mismatch)."""
    h = Harness(ReferenceBackend, "cpu", ModelGeometry())
    rid = h.add_request()
    snap = h.allocator.integrity_snapshot()
    with pytest.raises(HwkvError) as e:
        h.forward([rid, rid], [3, 3])
    assert not isinstance(e.value, ReferenceMismatchError), f"a harness misuse reported as a backend error: {e.value}"
    assert same_snapshot(snap, h.allocator.integrity_snapshot()), "the refused forward allocated slots"
    assert h.requests[rid].seq_len == 0


def test_an_empty_forward_returns_empty_outputs():
    """Defect: Harness.forward([], []) (an IDLE forward, or run_scenario(prompt_lens=())) dies in model_step's
    `o.reshape(0, -1)` with a bare RuntimeError; the backend itself runs it."""
    h = Harness(ReferenceBackend, "cpu", ModelGeometry())
    outs = h.forward([], [], ForwardMode.IDLE)
    assert [tuple(o.shape) for o in outs] == [(0, l.num_heads, l.v_head_dim) for l in h.layers]


def test_model_geometry_without_layers_is_refused():
    """Defect: ModelGeometry(num_layers=0) is taken; the first forward dies in torch.cat (bare ValueError)."""
    with pytest.raises(ConfigError, match="num_layers"):
        Harness(ReferenceBackend, "cpu", ModelGeometry(num_layers=0))


# ---- 5. spec_harness: refusals after the slots were taken -----------------------------------------------------
def _spec_harness():
    h = Harness(ReferenceBackend, "cpu", ModelGeometry(window=4), size=256, size_swa=64)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 4])
    return h, rids


def _state(h, rids):
    return h.allocator.integrity_snapshot(), h.rtt.req_to_token.clone(), [h.requests[r].seq_len for r in rids]


def _assert_unchanged(h, rids, before):
    snap, rows, seq = before
    assert same_snapshot(snap, h.allocator.integrity_snapshot()), "the refused call allocated slots"
    assert torch.equal(rows, h.rtt.req_to_token), "the refused call wrote req_to_token"
    assert seq == [h.requests[r].seq_len for r in rids], "the refused call moved the requests' lengths"


def test_tree_verify_with_trees_of_different_sizes_is_refused_before_allocating():
    """Defect: tree_verify sizes the batch by parents[0] and allocates; the backend's ShapeError comes after, leaving
    the requests' lengths past their shadow K/V (the next forward fails on the harness's own reference check)."""
    h, rids = _spec_harness()
    before = _state(h, rids)
    with pytest.raises(HwkvError):
        tree_verify(h, rids, [[-1, 0, 0], [-1, 0]], [[0], [0]])
    _assert_unchanged(h, rids, before)
    h.forward(rids, [1, 1])


def test_draft_steps_without_swa_writes_over_swa_layers_is_refused_before_allocating():
    """Defect: draft_steps(writes_swa=False) over the default layers (SWA ones included; its doc: they must be full)
    allocates the drafts' slots, then the backend raises MissingSWALocError: the slots leak (finish frees fewer)."""
    h, rids = _spec_harness()
    before = _state(h, rids)
    with pytest.raises(HwkvError):
        draft_steps(h, rids, 2, writes_swa=False)
    _assert_unchanged(h, rids, before)
    for r in rids:
        h.finish(r)
    assert (h.allocator.full_available_size(), h.allocator.swa_available_size()) == (256, 64), "slots leaked"
