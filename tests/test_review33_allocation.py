"""Session 33: an allocation cut short gives back what it took. A Ctrl-C (or any error) inside the allocator after it
popped pages, on the host path (numpy, CPU) and the torch ops' path alike, leaves every ring, reference count and the
full->SWA table as before, so the next allocation returns the slots an uninterrupted one would; one after the
allocation returned (the engine's req_to_token scatter, the batch) gives them back through `ForwardSlots.undo`.
Before, the popped pages were held by nobody: "a page is lost" (review 32's strict xfail, now a plain test)."""
from __future__ import annotations

import os
import signal
from typing import Callable, List, Tuple

import pytest
import torch

import hwkv.engine.forward as forward_mod
from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.batch import ForwardMode
from test_allocator import make
from test_review32_injection import _engine, _same_as_uninterrupted, _want

pytestmark = pytest.mark.usefixtures("one_thread", "python_sigint")  # conftest


def _sigint_in(monkeypatch, owner, name: str, when: Callable[..., bool] = lambda *a: True) -> List[int]:
    """A real SIGINT at the first call of `owner.name` whose arguments `when` accepts: a KeyboardInterrupt there,
    after what ran before it."""
    original, fired = getattr(owner, name), []

    def injected(*args, **kwargs):
        if not fired and when(*args):
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, injected)
    return fired


def _allocator(call: str, host: bool, churned: bool = True
               ) -> Tuple[SWATokenToKVPoolAllocator, Callable[[], torch.Tensor]]:
    """An SWA allocator (`churned`: whose pages were all allocated once and freed, the rings past their first pass),
    two requests holding 8 and 4 slots (page 4), and the allocation `call` makes for them: each opens a page (extend:
    5 tokens each, a page continued and two opened; decode: the token at 8 and at 4)."""
    _, a = make(size=64, size_swa=32, page=4)
    for _ in range(2 if churned else 0):  # (16 full pages, 8 SWA: every page of both rings taken and given back)
        a.free(a.alloc(a.swa_available_size()))
    a.host_ops = host
    first, second = a.alloc_extend([0], [8], [-1], 8), a.alloc_extend([0], [4], [-1], 4)
    last = [int(first[-1]), int(second[-1])]
    if call == "extend":
        return a, lambda: a.alloc_extend([8, 4], [13, 9], last, 10)
    return a, lambda: a.alloc_decode([9, 5], last)


@pytest.mark.parametrize("host", [True, False], ids=["host-path", "torch-ops"])
@pytest.mark.parametrize("call", ["extend", "decode"])
@pytest.mark.parametrize("at", ["swa-take", "next-op"])
def test_an_allocation_interrupted_after_it_popped_pages_leaves_the_allocator_as_it_was(monkeypatch, host, call, at):
    """A SIGINT as the SWA ring takes its pages (the full ring's taken) or at the op's numbering (both taken, the
    host path's refs and table written): KeyboardInterrupt, the allocator's snapshot as before, and the same call
    then returns what it returns on an allocator never interrupted, leaving the same state."""
    a, alloc = _allocator(call, host)
    before = a.integrity_snapshot()
    fired = _sigint_in(monkeypatch, *((a.swa_attn_allocator.pages, "take") if at == "swa-take" else (a, "_next_op")))
    with pytest.raises(KeyboardInterrupt):
        alloc()
    assert fired
    monkeypatch.undo()
    a.check_integrity()
    assert same_snapshot(a.integrity_snapshot(), before), "an interrupted allocation changed the allocator"
    b, alloc_b = _allocator(call, host)
    assert torch.equal(alloc(), alloc_b())
    assert same_snapshot(a.integrity_snapshot(), b.integrity_snapshot())


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_a_ctrl_c_after_the_allocation_returned_gives_its_pages_back(monkeypatch, mode):
    """A SIGINT as `ForwardSlots.allocate` makes the forward's batch (its slots allocated and scattered into
    req_to_token): the server loop that catches it and steps on gets the uninterrupted tokens, nothing held."""
    want = _want()
    e = _engine()
    fired = _sigint_in(monkeypatch, forward_mod, "ForwardBatch", when=lambda m, *a: m == mode)
    _same_as_uninterrupted(e, fired, want)
