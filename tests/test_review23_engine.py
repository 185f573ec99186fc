"""Review 23 (left open by review 22): the verify and whole-step paths check the model's logits shape as the plain
step does (`Engine._logits`): a model whose logits are wider than the vocabulary is refused with a ShapeError
inside the step's undo, every pool, row and frontier as before (where the release follows the layers; where the
device's page ops release in the allocation's launch, before the layers, those slots stay released and the host's
frontiers are synced); then the run gives a clean run's tokens. A wider verify row had been argmaxed to a token id
past the vocabulary and accepted as the model's next token."""
import numpy as np
import pytest
import torch
from conftest import triton_page_ops_on_cpu

from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ShapeError
from hwkv.graph import EagerAdapter
from hwkv.engine.drafters import prompt_lookup
from test_engine_defects import CPU, SHAPE, VOCAB, Flaky, _engine, _prompts, _run

pytestmark = pytest.mark.usefixtures("one_thread")


class Wider(Flaky):
    """The model, once armed, returning its logits with one more column than the vocabulary (after its layers)."""

    def __call__(self, batch, ids, pos, keep):
        out = self.model(batch, ids, pos, keep)
        armed, self.exc = self.exc, None
        return out if armed is None else torch.cat([out, out[:, :1] + 100.0], dim=1)


CASES = {
    "layers-graph": dict(graphs=EagerAdapter(), whole_step=False),
    "whole-step": dict(graphs=EagerAdapter(), whole_step=True, overlap=True),
    "verify": dict(draft=prompt_lookup()),
    "verify-graph": dict(draft=prompt_lookup(), graphs=EagerAdapter(), whole_step=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_wider_than_the_vocabulary_are_refused_on_every_path_and_the_step_runs_again(case):
    kw = CASES[case]
    prompts = [p + p[:9] for p in _prompts()] if "draft" in kw else _prompts()
    want = _run(*_engine(**kw), prompts)
    e, model = _engine(**kw)
    wider = Wider(model.model)
    e.model_step = wider
    assert _run(e, wider, prompts, exc=ShapeError("model_step returned logits of shape")) == want


def _device_release_engine(model_cls=None):
    """A whole-step engine whose allocator takes the device's page-op kernels (interpreted here) with deferred checks,
    so the step graph releases out-of-window slots in the allocation's launch, before the layers (as on a GPU)."""
    ops = triton_page_ops_on_cpu()
    plan = plan_pools(SHAPE, context=96, max_running=4, chunk=24, page_size=4, memory=None, device=CPU,
                      prefix_cache=False)
    cache = build_cache(SHAPE, plan, torch.float32, CPU, backend_device="cpu")
    a = cache.allocator
    a._ops = a.swa_attn_allocator._ops = ops
    a.immediate = False
    model = SyntheticModel(SHAPE, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    model = model if model_cls is None else model_cls(model)
    e = Engine(cache, model, stats=RunnerStats(SHAPE, plan), vocab_size=VOCAB, window=SHAPE.window,
               prefix_cache=False, overlap=False, graph_adapter=EagerAdapter(), graph_choice="eager", whole_step=True)
    assert e.graph._releases_first
    return e, model


def test_a_refused_whole_step_whose_release_ran_first_keeps_the_rows_and_syncs_the_frontiers():
    """Where the release runs before the layers, a refused step leaves those slots released (no query of the step,
    nor of its rerun, sees them): the requests' lengths and outputs are as before, the host's frontiers equal the
    device's, nothing leaks, and the run gives a clean run's tokens."""
    def run(e, model, fail):
        rid = e.add_request(list(range(1, 20)), SamplingParams(max_new_tokens=20))
        out, refused = {}, 0
        while e.has_work():
            if fail and not e.scheduler.waiting and all(r.decodes for r in e.scheduler.running):
                rows = [(r.kv_len, r.pending, list(r.output)) for r in e.scheduler.running]
                model.exc = True
                with pytest.raises(ShapeError, match="model_step returned logits of shape"):
                    e.step()
                refused += 1
                e.check_integrity()
                assert [(r.kv_len, r.pending, list(r.output)) for r in e.scheduler.running] == rows
                at = np.asarray([r.row for r in e.scheduler.running])
                assert np.array_equal(e.slots.frontiers_cpu[at], e.slots.frontiers[torch.from_numpy(at)].numpy())
            for r in e.step():
                out[r.rid] = r.tokens
            e.check_integrity()
        return out[rid], refused

    want, _ = run(*_device_release_engine(), fail=False)
    got, refused = run(*_device_release_engine(Wider), fail=True)
    assert got == want and refused >= 10
