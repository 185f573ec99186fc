"""Re-review of the review-34 fixes (280f1d9): defects the new refusals and the new state introduced.

Every test here fails on 280f1d9; each docstring names what is wrong and what is right. CPU only, tiny tensors and
tiny random transformers models (nothing downloaded), deterministic.
"""
from __future__ import annotations

import threading

import pytest
import torch

from hwkv import ops
from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.errors import ConfigError, DoubleFreeError
from hwkv.pool import SWAKVPool
from hwkv.req_to_token import ReqToTokenPool
from hwkv.spec import accept_draft_tokens

I64 = torch.int64


# ---- defect 1: move_kv's "dst named twice" refusal fires on the padding slot 0 of a request left as it is ------------

def _deferred_setup(page: int = 4, n: int = 4):
    """Two requests (prefixes 5, 6), n drafts each allocated and written; deferred checking (device-style) on the CPU."""
    pool = SWAKVPool(128, 64, page, torch.float32, 1, 4, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(128, 64, page, "cpu", pool)
    a.immediate = False
    rtt = ReqToTokenPool(2, 64, "cpu")
    rows = torch.tensor(rtt.alloc(2), dtype=I64)
    prefix = torch.tensor([5, 6], dtype=I64)
    loc = a.alloc_extend([0, 0], prefix.tolist(), [0, 0], 11)
    rtt.write(int(rows[0]), 0, loc[:5])
    rtt.write(int(rows[1]), 0, loc[5:])
    drafts = a.alloc_extend(prefix, prefix + n, rtt.req_to_token[rows, prefix - 1], 2 * n)
    for b in range(2):
        rtt.write(int(rows[b]), int(prefix[b]), drafts[b * n:(b + 1) * n])
    return pool, a, rtt, rows, prefix


def _accept(pool, a, rtt, rows, prefix, index, lens, n=4):
    idx = torch.zeros(2, n, dtype=I64)
    for b, x in enumerate(index):
        idx[b, :len(x)] = torch.tensor(x, dtype=I64)
    lens = torch.tensor(lens, dtype=I64)
    return accept_draft_tokens(a, pool, rtt.req_to_token, rows, prefix, idx, lens, prefix_lens_cpu=prefix,
                               accept_lens_cpu=lens)


def _kv(pool):
    return [b.clone() for sub in (pool.full_kv_pool, pool.swa_kv_pool) for b in (*sub.k_buffer, *sub.v_buffer)]


def test_a_second_accept_in_deferred_mode_is_recorded_not_refused_by_move_kv():
    """Wrong: `MHATokenToKVPool.check_move` now refuses any dst_loc naming a slot twice where values are checkable
    (always on the CPU). `accept_draft_tokens` at page size > 1 in deferred mode (allocator.immediate = False: the
    device-style path, which the CPU runs where a test or caller sets it) leaves a request whose drafts were already
    accepted "as it is": its move is onto itself (`move_kv(locs, locs)`), and its cleared draft positions hold the
    padding slot 0 -- several of them, so dst_loc names slot 0 twice and the new check raises
    `LocError: move_kv: dst_loc names slot 0 twice` in the middle of the accept, after the ERR_ACCEPTED record was
    written. tests/test_accept_draft.py's `test_accept_applied_twice_raises_and_changes_nothing[False-4]` and
    `test_accept_applied_twice_with_shorter_lengths_in_deferred_mode_changes_nothing[4]` fail the same way.

    Right (as before the fix, and as spec.py documents): the second accept returns, changes nothing (allocator,
    req_to_token, K/V), and the next sync raises DoubleFreeError "already accepted". The repeated-dst check must
    skip the padding slot 0 (a move of slot 0 onto itself is harmless; index_copy_ of equal values), in both
    groups (the SWA translation of those zeros is 0 as well)."""
    pool, a, rtt, rows, prefix = _deferred_setup()
    seq = _accept(pool, a, rtt, rows, prefix, [[0, 2], [1, 3]], [2, 2])
    a.check_integrity()
    snap, table, kv = a.integrity_snapshot(), rtt.req_to_token.clone(), _kv(pool)
    _accept(pool, a, rtt, rows, prefix, [[0], [1]], [1, 1])   # the same drafts again, shorter: left as they are
    assert same_snapshot(snap, a.integrity_snapshot()) and torch.equal(table, rtt.req_to_token)
    assert all(torch.equal(x, y) for x, y in zip(kv, _kv(pool))), "K/V moved"
    with pytest.raises(DoubleFreeError, match="already accepted"):
        a.check_integrity()
    assert seq.tolist() == [7, 8]


# ---- defect 2: ops.translate_into's torch fallback refuses int32 locs (torch.take takes int64 only) -------------------

def test_translate_into_fallback_takes_int32_locs_as_the_device_kernel_does():
    """Wrong: `hwkv.ops.translate_into` (the torch fallback, any device without registered refill kernels, the CPU
    included) now gathers with `torch.take`, which accepts only int64 indices: an int32 `loc` raises a bare
    `RuntimeError: take(): Expected a long tensor for index`. Before the fix (`index_select`) it translated, and the
    device kernel the fallback stands in for (hwkv_cuda.kernels.refill.translate_into, `_check_into`) documents and
    accepts "1-D int64/int32" locs.

    Right: the same result for int32 and int64 locs (e.g. `torch.take(mapping, loc.to(torch.int64), out=...)`, or
    `mapping.index_select` for locs >= 0 and `take` only for the -1 case)."""
    pool = SWAKVPool(64, 32, 4, torch.float32, 1, 4, [0], [1], "cpu")
    SWATokenToKVPoolAllocator(64, 32, 4, "cpu", pool)
    mapping = pool.full_to_swa_index_mapping
    loc64 = torch.tensor([4, 5, 6, -1], dtype=I64)
    want = torch.zeros(6, dtype=I64)
    ops.translate_into(mapping, loc64, want)
    got = torch.zeros(6, dtype=I64)
    ops.translate_into(mapping, loc64.to(torch.int32), got)
    assert torch.equal(got, want)


# ---- defect 3: RUNNING.model, a process-wide plain attribute, is left set by two runners stepping in two threads ----

transformers = pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")

from hwkv.integrations.hf_attention import RUNNING  # noqa: E402
from hwkv.integrations.transformers import HybridRunner, SamplingParams  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
            tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)


def _model(cfg_cls, **kw):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg_cls(**TINY, **kw), dtype=torch.float32,
                                                         attn_implementation="eager").eval()


def test_two_runners_stepping_in_two_threads_leave_running_unset():
    """Wrong: `_run_model` saves `outer = RUNNING.model`, sets its own class name and restores `outer` after the
    model call. RUNNING is one process-wide attribute, so two runners stepping in two threads (each on its own model:
    A enters, B enters and saves A's name as its `outer`, A leaves and restores None, B leaves and restores A's name)
    leave RUNNING.model naming A for good. From then on every model reaching hwkv attention outside any runner
    (a user calling it directly after a runner left it on 'hwkv', or a second runner's model dropping hwkv_forward=)
    is told "MistralForCausalLM's attention ... reached hwkv attention without hwkv_forward= during a HybridRunner
    step" -- naming a model that is not running, instead of "run the model through HybridRunner".

    Right: after both steps RUNNING.model is None again (a threading.local, or a per-thread stack; the value set
    around the model call must be the calling thread's own), and a direct call outside a runner gets the
    "run the model through hwkv.integrations.transformers.HybridRunner" message."""
    transformers.utils.logging.set_verbosity_error()
    model_a = _model(transformers.MistralConfig, sliding_window=6)
    model_b = _model(transformers.Gemma2Config, sliding_window=6, query_pre_attn_scalar=16)
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def hook_a(*_):
        if not a_in.is_set():
            a_in.set()
            b_in.wait(20)

    def hook_b(*_):
        if not b_in.is_set():
            b_in.set()
            a_done.wait(20)

    def run(model, hook, before=None, after=None):
        try:
            if before is not None:
                before.wait(20)
            handle = model.register_forward_pre_hook(hook)
            with HybridRunner(model, max_running=1, chunk=8, page_size=4, context=32, graphs="off") as r:
                r.add_request([1, 2, 3], SamplingParams(max_new_tokens=1))
                while r.has_work():
                    r.step()
            handle.remove()
        except BaseException as e:  # pragma: no cover (reported below)
            errors.append(e)
        finally:
            if after is not None:
                after.set()

    ta = threading.Thread(target=run, args=(model_a, hook_a, None, a_done))
    tb = threading.Thread(target=run, args=(model_b, hook_b, a_in, None))
    ta.start()
    tb.start()
    ta.join(60)
    tb.join(60)
    assert not errors, errors
    try:
        assert RUNNING.model is None, f"RUNNING.model left set to {RUNNING.model!r} after both runners' steps"
    finally:
        RUNNING.model = None   # (do not leak into other tests)
