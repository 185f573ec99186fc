"""Review 29, re-review of the ambient-state fix (f7fb09f): what `normal_tensors` and the detaches left out.

The fix made the pools, allocators, ReqToTokenPool and `make_backend` build normal tensors under
`torch.inference_mode()`, left autocast in the CPU dense path and the reference, and detached a query or K/V that
requires grad. The README now says: "hwkv's attention is inference-only and ignores the caller's ambient torch
state ... state built inside `torch.inference_mode()` steps outside it too". That holds for the decorated
constructors only: every other long-lived tensor hwkv makes (graph state, graph runners, the engine's step
primitives, lazily made graph buffers) is still an inference tensor when made under inference mode, and a later
step under `torch.no_grad()` raises torch's raw `RuntimeError: Inplace update to inference tensor outside
InferenceMode is not allowed`. Sinks that require grad (an nn.Parameter, as a model holds them) reach the dense
path's kept column undetached; hwkv's synthetic model follows the caller's autocast.

Checked and found fine (no test here): state made lazily during eager steps in one mode and updated in another
(dense plans, kept sink columns, per-thread workspaces, the forward counter, KeptRange constants, prefix cache
nodes and their locs, release), in both orders (inference -> no_grad -> grad, no_grad -> inference -> grad),
chunked, dense and graph ("eager" adapter) decode/extend, eager tree verify ("extend" and "decode"), eager
multi-step drafts; GraphRunner captured (only) under inference mode for decode and extend-verify; TorchCPUBackend
built directly (not through make_backend) under inference mode; HybridPrefixCache and StagingRing built under
inference mode; HybridRunner built under inference mode, generating under no_grad / enable_grad (graphs off and
eager); Engine built under inference mode (its steps run in inference mode); autocast (bf16) around chunked and
dense decode/extend, graphs, tree verify (extend and decode-like, eager and graph), drafts (eager and graph), a
bf16 pool through the AMX-dtype chunked path (compute dtype forced to bf16): identical to the run without it;
q, k and v requiring grad through dense and chunked paths (outputs without grad, pools outside the graph); CP
(`cp_allgather_and_save_kv`, gloo, world 1) with K/V requiring grad, under autocast, and planned under inference
mode; the decorator keeps names, docstrings and signatures (functools.wraps: inspect.signature of each class and
of make_backend), pickling of make_backend and of a pool, subclass chains (TokenToKVPoolAllocator), and wraps
only constructors (no per-step cost).

Each test below is one defect: it fails on the current code and passes once fixed (or refused with a typed hwkv
error, where that is offered). CPU, fp32, tiny shapes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import pytest
import torch

import hwkv
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import HwkvError, ReferenceMismatchError
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.pool import SWAKVPool
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv_cpu.backend import TorchCPUBackend

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

GEOM = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16, sinks=True)


def _harness(**options) -> Harness:
    """Two layers (SWA W=4 with sinks, full) over hybrid pools, built outside any ambient mode."""
    return Harness(TorchCPUBackend, "cpu", GEOM, size=256, size_swa=64, max_reqs=8, **options)


def _runs_or_refuses(run: Callable[[], object]) -> None:
    """`run()` completes (its outputs checked against hwkv.reference by the harness) or refuses with a typed
    hwkv error; a raw torch error escapes, and a reference mismatch fails."""
    try:
        run()
    except ReferenceMismatchError:
        raise
    except HwkvError:
        return


def _prefill_and_decode(h: Harness, decodes: int = 3) -> None:
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [5, 9, 3], ForwardMode.EXTEND)
    h.release()
    for _ in range(decodes):
        h.forward(rids, [1, 1, 1], ForwardMode.DECODE)
        h.release()


# ---- 1. the backend's graph state made in inference mode --------------------------------------------------------
@pytest.mark.parametrize("draft", [False, True], ids=["init_graph_state", "init_draft_graph_state"])
def test_graph_state_made_in_inference_mode_is_refilled_outside_it(draft):
    """`backend.init_graph_state(...)` (or `init_draft_graph_state`) called under `torch.inference_mode()` (an engine
    sizing its graphs at start-up), then graphs captured and replayed outside it: the static buffers are inference
    tensors (hwkv/backend.py:436 `alloc_static`, hwkv/backend.py:438 -> hwkv/loc.py:120 the SWA write-loc buffer,
    hwkv/spec_plan.py:37 the tree buffers; draft: hwkv/draft.py:152-159), and the first refill raises torch's raw
    `Inplace update to inference tensor outside InferenceMode` (hwkv/loc.py `refill` -> the pool's translate into
    the static buffer). `make_backend` is decorated with `normal_tensors`; these methods, which make the backend's
    longest-lived tensors, are not."""
    from hwkv.testing.spec_harness import draft_graphs, draft_steps
    h = _harness()
    with torch.inference_mode():
        if draft:
            h.backend.init_draft_graph_state(2, 3)
        else:
            h.backend.init_graph_state(4, 4)

    def run():
        with torch.no_grad():
            if draft:
                rids = [h.add_request() for _ in range(2)]
                h.forward(rids, [9, 3], ForwardMode.EXTEND)
                draft_steps(h, rids, 3, runner=draft_graphs(h, [2], EagerAdapter(), 3))
            else:
                h.enable_graphs([1, 2, 4], EagerAdapter())
                _prefill_and_decode(h)
    _runs_or_refuses(run)


# ---- 2. graph runners built in inference mode ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["GraphRunner", "DraftGraphRunner", "DecodeStepGraph"])
def test_graph_runners_built_in_inference_mode_run_outside_it(kind):
    """A GraphRunner (and its subclasses) built under `torch.inference_mode()`, the backend's graph state made
    normally beforehand: the runner's own static batch and inputs are inference tensors (hwkv/graph.py:89-103
    `req_pool_indices`, `seq_lens`, `out_cache_loc`, ..., `inputs`; DecodeStepGraph: hwkv/step_graph.py:92 `staged`,
    :112-113; DraftStepGraph: :444-446), and its capture or its first step outside inference mode raises the raw
    `Inplace update to inference tensor outside InferenceMode` (GraphRunner: hwkv/graph.py:238 `_pad`; then :312
    in `prepare`; DraftGraphRunner: hwkv/draft.py:384 `_pad`; DecodeStepGraph: hwkv/step_graph.py:210 `_set_ctl`
    -> hwkv/staging.py:54 `dst.copy_(src)` into `staged`). Expected: their constructors made normal tensors as the
    pools' are (`normal_tensors`), or a typed refusal."""
    from hwkv.testing.spec_harness import draft_model, draft_steps
    h = _harness()
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 3], ForwardMode.EXTEND)
    h.release()
    if kind == "DraftGraphRunner":
        from hwkv.draft import DraftGraphRunner
        h.backend.init_draft_graph_state(2, 3)   # normal tensors: only the runner is made in inference mode
        shapes = h._input_shapes()
        with torch.inference_mode():
            runner = DraftGraphRunner(h.backend, draft_model(h, h.layers), [2], shapes, 3, EagerAdapter())

        def run():
            with torch.no_grad():
                runner.capture()
                draft_steps(h, rids, 3, runner=runner)
    elif kind == "DecodeStepGraph":
        from hwkv.step_graph import DecodeStepGraph
        h.backend.init_graph_state(4, 4)
        with torch.inference_mode():
            h.step_graph = DecodeStepGraph(h.backend, h.allocator, h.model_step, [1, 2, 4], h._input_shapes(),
                                           EagerAdapter(), h.slots.frontiers, GEOM.window)

        def run():
            with torch.no_grad():
                h.step_graph.capture()
                for _ in range(2):
                    h.step_graph_decode(rids)
    else:
        h.backend.init_graph_state(4, 4)
        with torch.inference_mode():
            h.runner = GraphRunner(h.backend, h.model_step, [1, 2, 4], h._input_shapes(), EagerAdapter())

        def run():
            with torch.no_grad():
                h.runner.capture()
                for _ in range(2):
                    h.forward(rids, [1, 1], ForwardMode.DECODE)
                    h.release()
    _runs_or_refuses(run)


# ---- 3. a graph buffer made lazily, at capture, in inference mode -------------------------------------------------
def test_decode_like_verify_graph_captured_in_inference_mode_replays_outside_it():
    """tree_verify="decode" with a verify GraphRunner(tree=True) built normally and captured under
    `torch.inference_mode()` (as hwkv's own Engine captures): the decode-like verify's static lists are made lazily
    by the capture's warm-up refill (hwkv/spec_plan.py:114 `alloc_tree_decode`, :116 `_token_arange`), so they are
    inference tensors, and every replay outside inference mode raises the raw `Inplace update to inference tensor
    outside InferenceMode` (hwkv/spec_plan.py `decode_lists` -> hwkv/spec.py `tree_decode_list` -> hwkv/metadata.py
    `fill_list`). The extend-kernel verify ("extend"), whose buffers `init_graph_state` made, replays fine."""
    from hwkv.testing.spec_harness import tree_verify
    h = _harness(tree_verify="decode")
    h.runner = GraphRunner(h.backend, h.model_step, [2], h._input_shapes(), EagerAdapter(),
                           ForwardMode.TARGET_VERIFY, tokens_per_req=5, tree=True)
    with torch.inference_mode():
        h.runner.capture()
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 3], ForwardMode.EXTEND)

    def run():
        with torch.no_grad():
            tree_verify(h, rids, [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]], [[0, 2], [0, 1, 2]])
    _runs_or_refuses(run)


# ---- 4. the engine's step primitives built in inference mode -----------------------------------------------------
def test_forward_slots_built_in_inference_mode_step_outside_it():
    """`hwkv.engine.forward.ForwardSlots` (docs/architecture.md: the engine's step bookkeeping, which the contract
    harness steps on) built under `torch.inference_mode()` over normal pools: its per-row release frontiers
    (hwkv/engine/forward.py:120 `self.frontiers = torch.zeros(...)`) are an inference tensor, and the first request
    row taken under `torch.no_grad()` raises the raw `Inplace update to inference tensor outside InferenceMode`
    (hwkv/engine/forward.py:129 `self.frontiers[...] = 0`; then the release)."""
    from hwkv.engine.forward import ForwardSlots
    h = _harness()
    with torch.inference_mode():
        h.slots = ForwardSlots(h.allocator, h.rtt, GEOM.window)

    def run():
        with torch.no_grad():
            _prefill_and_decode(h)
    _runs_or_refuses(run)


# ---- 5. sinks that require grad (a model's parameter) in grad mode ---------------------------------------------------
W, P, H, KVH, D = 4, 4, 4, 2, 16


def _mini(sinks: torch.Tensor):
    pool = SWAKVPool(size=128, size_swa=64, page_size=P, dtype=torch.float32, head_num=KVH, head_dim=D,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    alloc = SWATokenToKVPoolAllocator(128, 64, P, "cpu", pool)
    rtt = hwkv.ReqToTokenPool(size=2, max_context_len=64, device="cpu")
    backend = hwkv.make_backend(pool, rtt, device="cpu", sliding_window=W)
    layer = hwkv.AttentionLayer(0, H, KVH, D, sliding_window=W, sinks=sinks)
    return alloc, rtt, backend, layer


def _steps(sinks: torch.Tensor, grad_in: Optional[ForwardMode] = None) -> List[torch.Tensor]:
    """One request: an EXTEND of 6 tokens then one DECODE through the SWA layer (the step of mode `grad_in` under
    torch.enable_grad(), the other under torch.no_grad(); all plain without `grad_in`); the outputs of both."""
    alloc, rtt, backend, layer = _mini(sinks)
    g = torch.Generator(device="cpu").manual_seed(3)
    row = rtt.alloc(1)[0]
    outs = []
    for mode, prefix, seq in ((ForwardMode.EXTEND, 0, 6), (ForwardMode.DECODE, 6, 7)):
        n = seq - prefix
        if mode == ForwardMode.EXTEND:
            loc = alloc.alloc_extend(prefix_lens=[0], seq_lens=[seq], last_loc=[0], extend_num_tokens=n)
        else:
            loc = alloc.alloc_decode(torch.tensor([seq]), rtt.req_to_token[[row], seq - 2],
                                     seq_lens_cpu=torch.tensor([seq]))
        rtt.write(row, prefix, loc)
        batch = ForwardBatch(mode, 1, torch.tensor([row]), torch.tensor([seq]), loc,
                             extend_prefix_lens=torch.tensor([prefix]), extend_seq_lens=torch.tensor([n]),
                             seq_lens_cpu=torch.tensor([seq]))
        backend.init_forward_metadata(batch)
        q, k, v = (torch.randn(n, h, D, generator=g) for h in (H, KVH, KVH))
        ctx = contextlib.nullcontext() if grad_in is None else torch.enable_grad() if mode == grad_in else torch.no_grad()
        with ctx:
            outs.append(backend.forward(q, k, v, layer, batch))
    return outs


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_sinks_that_require_grad_give_the_output_without_grad_in_grad_mode(mode):
    """A layer whose sinks are the model's nn.Parameter (requires_grad=True, as GPT-OSS's `sinks` are; the low-level
    API takes any float tensor, and hwkv's HF integration detaches them but an engine wiring layers itself need not),
    a step run in grad mode (the engine's forward outside no_grad; q, k and v plain) on the CPU dense path:
    - decode: hwkv_cpu/backend.py:205 `dst.copy_(src)` copies the sinks into the kept column (`kept_sink_column`)
      recording autograd (the column then requires grad and holds a graph to the parameter for the backend's life),
      and hwkv_cpu/kernels_dense.py:217 `torch.bmm(p, v, out=...)` raises the raw `RuntimeError: bmm(): functions
      with out=... arguments don't support automatic differentiation, but one of the arguments requires grad`;
    - extend: hwkv_cpu/kernels_dense.py:140 `sink_column` (`sinks.to(cdt)`, undetached) puts the sinks into the
      product, and the layer's output requires grad (it joined the caller's graph), which no other path gives (the
      chunked kernels' `_norm_sinks` detaches them).
    The fix detached q only (kernels_dense.py `dense_attention`). Expected: the output of the same call with plain
    sinks, without grad (or a typed refusal)."""
    values = torch.linspace(-1, 1, H)
    want = _steps(values.clone())
    try:
        got = _steps(torch.nn.Parameter(values.clone()), grad_in=mode)
    except HwkvError:
        return
    for name, a, b in zip(("extend", "decode"), got, want):
        assert not a.requires_grad, f"{name}: the output requires grad ({a.grad_fn}): it joined the caller's graph"
        assert (a.detach() - b).abs().max().item() < 1e-5, name


# ---- 6. hwkv's synthetic model follows the caller's autocast ------------------------------------------------------
def test_synthetic_engine_under_autocast_gives_the_tokens_it_gives_without_it():
    """`hwkv.engine.synthetic.SyntheticModel(dtype=torch.float32)` documents logits "[K, vocab] fp32", and the fix
    made it "the model its seed and dtype name" whatever the default dtype; under `torch.autocast("cpu",
    dtype=torch.bfloat16)` its readout and unembedding (hwkv/engine/synthetic.py:138 `... @ readout`, :142
    `acc @ self._unembed`) run in bf16 and return bf16 logits, so a greedy Engine.generate picks other tokens
    (request 2 of this run differs from its 4th token on) while hwkv's attention under it is exact (ReferenceCheck
    passes). Expected: the same tokens (the model leaves autocast, as hwkv's dense path and reference now do)."""
    from hwkv.engine.sampling import SamplingParams
    from test_review29_ambient import synthetic_engine

    def tokens(ctx):
        e = synthetic_engine()
        with ctx():
            return [r.tokens for r in e.generate([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [9, 8, 7, 9, 8, 7, 9, 8]],
                                                 SamplingParams(max_new_tokens=8))]
    want = tokens(contextlib.nullcontext)
    assert tokens(lambda: torch.autocast("cpu", dtype=torch.bfloat16)) == want
