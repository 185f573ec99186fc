"""Review 29: ambient torch state a user's process may have set around hwkv's calls.

An engine calls hwkv from a process whose torch settings hwkv does not own: the default dtype and device,
deterministic algorithms, grad / no_grad / inference mode, autocast, the thread count, the global RNG, anomaly
detection. hwkv must give the answer it gives without the setting (or refuse with a typed `hwkv.errors` error);
never a raw torch traceback from deep inside, a silently less precise or re-typed result, a pool that joins the
caller's autograd graph, or a mutated caller tensor.

Checked and found acceptable (no test here): the default dtype (fp16, bf16, fp64) before construction and between
steps on the allocator, pools, backend, public CPU kernels, reference and HybridRunner.generate (graphs off and
eager, prefix cache and sampling included); a meta default device; deterministic algorithms with and without
warn_only (uninitialised memory filled); inference_mode / no_grad / enable_grad / anomaly detection around
HybridRunner.generate and around low-level steps, alternating per step; the thread count (1 or 4, also between
steps: identical outputs); the global RNG (generate neither reads nor advances it, greedy or sampled; a request's
tokens depend on its seed only); grad enabled with parameters requiring grad over 70 runner steps (no tensor growth).

Each test below is one defect: it fails on the current code and passes once fixed. CPU, fp32, tiny shapes.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Callable, List, Optional

import pytest
import torch

import hwkv
import hwkv.reference as reference
from hwkv.allocator import SWATokenToKVPoolAllocator, release_out_of_window_batch
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import HwkvError
from hwkv.pool import SWAKVPool

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

W, P, H, KVH, D = 8, 4, 4, 2, 16
PROMPTS = (13, 6)


def autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class Mini:
    """The README's engine wiring at toy size: an SWA layer (W=8, sinks) and a full layer over hybrid pools, two
    requests prefilled in one EXTEND, then DECODE steps with out-of-window release. `dense=False` turns the CPU
    backend's dense path off (the chunked kernels, what graphs and large batches run)."""

    def __init__(self, dense: bool = True, build=contextlib.nullcontext) -> None:
        with build():   # hwkv's objects only: the test's own tensors below are made outside it
            self.pool = SWAKVPool(size=256, size_swa=64, page_size=P, dtype=torch.float32, head_num=KVH, head_dim=D,
                                  swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
            self.alloc = SWATokenToKVPoolAllocator(256, 64, P, "cpu", self.pool)
            self.rtt = hwkv.ReqToTokenPool(size=4, max_context_len=128, device="cpu")
            opts = {} if dense else {"dense_max_elements": 0}
            self.backend = hwkv.make_backend(self.pool, self.rtt, device="cpu", sliding_window=W, **opts)
        sinks = torch.linspace(-1, 1, H, dtype=torch.float32, device="cpu")
        self.layers = [hwkv.AttentionLayer(0, H, KVH, D, sliding_window=W, sinks=sinks),
                       hwkv.AttentionLayer(1, H, KVH, D)]
        self.rows = torch.tensor([self.rtt.alloc(1)[0] for _ in PROMPTS], device="cpu")
        self.seq = torch.tensor(PROMPTS, device="cpu")
        self.frontiers = torch.zeros(len(PROMPTS), dtype=torch.int64, device="cpu")
        self.steps = 0

    @staticmethod
    def qkv(n: int, seed: int):
        g = torch.Generator(device="cpu").manual_seed(seed)
        return (torch.randn(n, H, D, generator=g, device="cpu"), torch.randn(n, KVH, D, generator=g, device="cpu"),
                torch.randn(n, KVH, D, generator=g, device="cpu"))

    def _layers(self, batch: ForwardBatch, n: int,
                make: Optional[Callable[[int, int], tuple]] = None) -> List[torch.Tensor]:
        self.backend.init_forward_metadata(batch)
        outs = []
        for i, layer in enumerate(self.layers):
            q, k, v = (make or self.qkv)(n, 100 * self.steps + i)
            outs.append(self.backend.forward(q, k, v, layer, batch))
        release_out_of_window_batch(self.alloc, self.rtt.req_to_token, self.rows, self.seq, self.frontiers, W)
        self.steps += 1
        return outs

    def extend(self, make=None) -> List[torch.Tensor]:
        n = sum(PROMPTS)
        loc = self.alloc.alloc_extend(prefix_lens=[0, 0], seq_lens=list(PROMPTS), last_loc=[0, 0],
                                      extend_num_tokens=n)
        self.rtt.write(int(self.rows[0]), 0, loc[:PROMPTS[0]])
        self.rtt.write(int(self.rows[1]), 0, loc[PROMPTS[0]:])
        batch = ForwardBatch(ForwardMode.EXTEND, 2, self.rows, self.seq, loc,
                             extend_prefix_lens=torch.zeros(2, dtype=torch.int64, device="cpu"),
                             extend_seq_lens=self.seq.clone(), seq_lens_cpu=self.seq.clone())
        return self._layers(batch, n, make)

    def decode(self, make=None) -> List[torch.Tensor]:
        self.seq = self.seq + 1
        loc = self.alloc.alloc_decode(self.seq, self.rtt.req_to_token[self.rows, self.seq - 2],
                                      seq_lens_cpu=self.seq.clone())
        self.rtt.req_to_token[self.rows, self.seq - 1] = loc
        batch = ForwardBatch(ForwardMode.DECODE, 2, self.rows, self.seq, loc, seq_lens_cpu=self.seq.clone())
        return self._layers(batch, 2, make)


def _max_err(got: List[torch.Tensor], want: List[torch.Tensor]) -> float:
    return max((a.detach().double() - b.detach().double()).abs().max().item() for a, b in zip(got, want))


def _same_or_typed(run: Callable[[], List[torch.Tensor]], want: List[torch.Tensor], what: str) -> None:
    """`run()` gives `want` (fp32: within 1e-4, the contract suite's bound, in fp32) or refuses with a typed error."""
    try:
        got = run()
    except HwkvError:
        return
    assert all(g.dtype == torch.float32 for g in got), f"{what}: output dtypes {[g.dtype for g in got]}"
    err = _max_err(got, want)
    assert err < 1e-4, f"{what}: max |out - out without the setting| = {err:.3g}"


# ---- 1. autocast around a decode step: the CPU dense path raises torch's raw dtype error -------------------------
def test_autocast_around_a_decode_step_gives_the_same_output_or_a_typed_error():
    """`with torch.autocast("cpu", dtype=torch.bfloat16):` around an eager decode forward over fp32 pools raises a raw
    `RuntimeError: expected scalar type Float but found BFloat16` from hwkv_cpu/kernels_dense.py `dense_attention`
    (`torch.bmm(p, v, out=out.view(...))`: autocast casts p and v to bf16, `out` is the fp32 output). The chunked
    kernels (custom ops) give the exact fp32 answer under the same autocast. Through HybridRunner the same error
    ends a Gemma 2 generate (test 4)."""
    want_m = Mini()
    want_m.extend()
    want = want_m.decode()
    m = Mini()
    m.extend()

    def run():
        with autocast_bf16():
            return m.decode()
    _same_or_typed(run, want, "decode under autocast")


# ---- 2. autocast around a prefill: the dense path silently computes in bf16 --------------------------------------
def test_autocast_around_an_extend_step_keeps_fp32_attention_exact():
    """Under CPU autocast (bf16) the dense extend path's `baddbmm`/`bmm` (hwkv_cpu/kernels_dense.py dense_attention)
    are autocast to bf16, so an fp32 pool's prefill attention is off by 1.3e-2 (fp32 must agree within 1e-4),
    silently, and in an fp32 `out`; the chunked path (dense_max_elements=0) gives the same call's answer exactly.
    The engine's reference check (hwkv.engine.synthetic.ReferenceCheck) then reports a ReferenceMismatchError in an
    EXTEND forward of the engine run under autocast. Expected: the answer does not depend on the caller's autocast
    (or a typed refusal)."""
    want = Mini().extend()
    chunked = Mini(dense=False)
    with autocast_bf16():
        assert _max_err(chunked.extend(), want) < 1e-4   # the chunked kernels ignore autocast

    def run():
        with autocast_bf16():
            return Mini().extend()
    _same_or_typed(run, want, "dense extend under autocast")


# ---- 3. the oracle under autocast: hwkv.reference returns bf16 -------------------------------------------------
@pytest.mark.parametrize("fn", ["attention", "batch_attention"])
def test_reference_under_autocast_stays_fp32(fn):
    """hwkv.reference.attention documents `-> [Tq, H, Dv] fp32`, but its two `torch.einsum`s are autocast to bf16:
    under `torch.autocast("cpu", dtype=torch.bfloat16)` it returns a bf16 tensor off by 8e-3 from its own fp32
    answer (batch_attention too). The oracle an engine's tests compare against must not follow the caller's
    autocast (ReferenceCheck runs inside the engine's step, where a caller's autocast holds)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(5, H, D, generator=g, device="cpu")
    k = torch.randn(9, KVH, D, generator=g, device="cpu")
    v = torch.randn(9, KVH, D, generator=g, device="cpu")

    def call():
        if fn == "attention":
            return reference.attention(q, k, v, torch.arange(4, 9, device="cpu"), torch.arange(9, device="cpu"),
                                       window=4)
        return reference.batch_attention(q, [k], [v], [9], [5], window=4)
    want = call()
    with autocast_bf16():
        got = call()
    assert got.dtype == torch.float32, f"reference under autocast returned {got.dtype}"
    assert (got - want).abs().max().item() < 1e-6


# ---- 4. the same through HybridRunner.generate ---------------------------------------------------------------
def test_generate_under_autocast_gives_the_same_tokens_or_a_typed_error():
    """`with torch.autocast("cpu", dtype=torch.bfloat16): runner.generate(...)` on the tiny Gemma 2 (graphs off)
    ends in the raw RuntimeError of test 1 (kernels_dense.py, `torch.bmm(..., out=...)`), out of generate. The same
    call gives the tokens it gives without autocast with graphs="eager" and for the tiny GPT-OSS (and transformers'
    own greedy generate under autocast gives those tokens too)."""
    transformers = pytest.importorskip("transformers", reason="hwkv's test extra")
    from hwkv.integrations.transformers import HybridRunner, SamplingParams
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
                  tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    cfg = transformers.Gemma2Config(**common, sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0)
    with torch.random.fork_rng():   # the global RNG as it was, for the tests after this one
        torch.manual_seed(2)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    g = torch.Generator(device="cpu").manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 11, 20)]
    params = SamplingParams(max_new_tokens=6)

    def tokens(ctx):
        with HybridRunner(model, graphs="off", max_running=4, context=64, page_size=4) as r:
            with ctx():
                out = [x.tokens for x in r.generate(prompts, params)]
            r.check_integrity()
        return out
    want = tokens(contextlib.nullcontext)
    try:
        got = tokens(autocast_bf16)
    except HwkvError:
        return
    assert got == want


# ---- 5. grad mode with k/v that require grad: the pools join the caller's autograd graph -------------------------
@pytest.mark.parametrize("dense", [True, False])
def test_a_forward_in_grad_mode_leaves_the_pools_out_of_the_autograd_graph(dense):
    """An engine that computes q/k/v with a model whose parameters require grad, outside no_grad/inference_mode,
    hands hwkv tensors with a grad_fn. hwkv/ops.py `store_kv_torch` (`k_buf.index_copy_(0, loc, k)`) then makes the
    pool's K/V buffers part of that graph (`requires_grad=True`, grad_fn IndexCopyBackward0): every later step chains
    two more nodes onto each buffer (82 nodes after 40 decode steps) and the graph keeps every step's activations
    alive for as long as the pool lives (here the input of the model's projection outlives the step). Expected: the
    pool never joins a graph (store detached values; hwkv's attention is not differentiable anyway: the chunked
    path returns outputs without grad), or a typed refusal before anything is written."""
    m = Mini(dense=dense)
    with torch.random.fork_rng():
        proj = torch.nn.Linear(D, D, device="cpu")   # parameters require grad, as a model's do
    g = torch.Generator(device="cpu").manual_seed(5)
    seen = []

    def make(n, seed):
        q, k, v = Mini.qkv(n, seed)
        x = torch.randn(n, KVH, D, generator=g, device="cpu")
        seen.append(weakref.ref(x))
        return q, proj(x), v
    with torch.enable_grad():
        try:
            m.extend(make)
        except HwkvError:
            return
    for lid in (0, 1):
        for buf in m.pool.get_kv_buffer(lid):
            assert not buf.requires_grad and buf.grad_fn is None, \
                f"layer {lid}'s pool buffer joined the autograd graph ({buf.grad_fn})"
    gc.collect()
    assert all(r() is None for r in seen), "a step's activations are kept alive by the pool"


# ---- 6. grad mode with a query that requires grad: raw error from the dense decode -----------------------------
def test_a_decode_with_a_query_requiring_grad_gives_the_output_or_a_typed_error():
    """q with requires_grad=True in grad mode (k and v plain) through an eager decode forward: hwkv_cpu/kernels_dense.py
    `torch.bmm(p, v, out=...)` raises `RuntimeError: bmm(): functions with out=... arguments don't support automatic
    differentiation, but one of the arguments requires grad`. The chunked kernels return the output (without grad)
    and the dense extend path returns it with a graph: three behaviours for one call. Expected: the output (the
    same as with q detached) or a typed refusal."""
    want_m = Mini()
    want_m.extend()
    want = want_m.decode()
    m = Mini()
    m.extend()

    def make(n, seed):
        q, k, v = Mini.qkv(n, seed)
        return q.requires_grad_(), k, v

    def run():
        with torch.enable_grad():
            return m.decode(make)
    _same_or_typed(run, want, "decode with q requiring grad")


# ---- 7. state built in inference mode, stepped outside it ------------------------------------------------------
def test_pools_built_in_inference_mode_step_outside_it_or_refuse_with_a_typed_error():
    """Pools, allocator, ReqToTokenPool and backend built inside `torch.inference_mode()` (an engine's start-up code
    often runs under it; the caller's own tensors are made outside it) are inference tensors; a later step under `torch.no_grad()` raises torch's raw `RuntimeError:
    Inplace update to inference tensor outside InferenceMode is not allowed` from hwkv/req_to_token.py `write`
    (then from the allocator, the pool's store, the release). Built outside, steps in either mode (alternating too)
    run. Expected: hwkv's persistent state made as normal tensors (`torch.inference_mode(False)` in the
    constructors), or a typed error naming inference mode."""
    want = Mini().extend()
    m = Mini(build=torch.inference_mode)

    def run():
        with torch.no_grad():
            return m.extend()
    _same_or_typed(run, want, "state built in inference mode")


# ---- 8. SyntheticModel built under another default dtype ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_synthetic_model_built_under_another_default_dtype_is_the_fp32_model(dtype):
    """hwkv.engine.synthetic.SyntheticModel(dtype=torch.float32) draws its tables, sinks, readouts and unembedding
    with `torch.randn(..., generator=gen, device="cpu")` and no dtype, i.e. in torch's default dtype: built after
    `torch.set_default_dtype(torch.float64)` (or bf16) the engine's first forward raises a raw `RuntimeError:
    expected m1 and m2 to have the same dtype` (synthetic.py `__call__`, the fp32 layer output @ a float64 readout;
    with graphs="eager" it surfaces as a ConfigError blaming the graph capture), and even a matching matmul would
    draw other values (float64 draws are another stream). Expected: the model is the one its seed and dtype name."""
    from hwkv.engine.sampling import SamplingParams

    def tokens(build_dtype):
        with default_dtype(build_dtype):
            e = synthetic_engine()
        return [r.tokens for r in e.generate([[1, 2, 3, 4, 5], [9, 8, 7]], SamplingParams(max_new_tokens=5))]
    want = tokens(torch.float32)
    assert tokens(dtype) == want


def synthetic_engine():
    """A tiny SyntheticModel engine on the CPU (one SWA and one full layer, sinks, fp32 pools, no prefix cache)."""
    from hwkv.engine.engine import Engine
    from hwkv.engine.pools import build_cache, plan_pools
    from hwkv.engine.presets import ModelShape
    from hwkv.engine.stats import RunnerStats
    from hwkv.engine.synthetic import SyntheticModel

    cpu = torch.device("cpu")
    shape = ModelShape(name="tiny", layer_is_swa=(True, False), window=8, num_heads=4, num_kv_heads=2, head_dim=16,
                       swa_sinks=True, dtype_bytes=4)
    plan = plan_pools(shape, context=64, max_running=2, chunk=24, page_size=4, memory=None, device=cpu,
                      prefix_cache=False)
    cache = build_cache(shape, plan, torch.float32, cpu, backend_device="cpu")
    model = SyntheticModel(shape, cache.backend, vocab_size=97, dtype=torch.float32, device=cpu,
                           positions=cache.rtt.max_context_len, seed=3)
    return Engine(cache, model, stats=RunnerStats(shape, plan), vocab_size=97, window=8, prefix_cache=False)
