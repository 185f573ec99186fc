"""Review 22 (the engine loop): a model_step whose logits are not one row per kept token is refused before the step
commits anything."""
import pytest
import torch

from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.presets import ModelShape, layer_pattern
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ShapeError

CPU = torch.device("cpu")
SHAPE = ModelShape(name="tiny", layer_is_swa=layer_pattern(4, "sf"), window=8, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype_bytes=4)


@pytest.mark.parametrize("wrong", ["every token", "wider"])
def test_logits_that_are_not_one_row_per_kept_token_are_refused_and_the_step_runs_again(wrong):
    """Logits of every token (an HF model ignoring a tensor logits_to_keep) had failed in torch after the requests'
    lengths moved on: the tokens lost, `pending` stuck, the request one token short. Now a ShapeError naming both
    shapes, the step undone; a model that keeps its rows then runs the same requests to the end."""
    plan = plan_pools(SHAPE, context=64, max_running=4, chunk=8, page_size=4, memory=None, device=CPU,
                      prefix_cache=True)
    cache = build_cache(SHAPE, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(SHAPE, cache.backend, vocab_size=97, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    broken = [True]

    def step(batch, ids, pos, keep):
        if not broken[0]:
            return model(batch, ids, pos, keep)
        if wrong == "every token":
            return model(batch, ids, pos, 0)
        out = model(batch, ids, pos, keep)
        return torch.cat([out, out[:, :1]], dim=1)

    e = Engine(cache, step, stats=RunnerStats(SHAPE, plan), vocab_size=97, window=8, overlap=False)
    a = e.add_request([1, 2, 3], SamplingParams(max_new_tokens=5))
    b = e.add_request(list(range(1, 13)), SamplingParams(max_new_tokens=5))
    want = r"model_step returned logits of shape \[\d+, \d+\], expected \[\d+, V\] with V <= vocab_size 97"
    with pytest.raises(ShapeError, match=want):
        e.step()
    assert [(r.kv_len, r.pending, r.output) for r in e.scheduler.running] == [(0, 0, [])] * 2
    e.check_integrity()
    broken[0] = False
    done = {}
    while e.has_work():
        for res in e.step():
            done[res.rid] = res
    assert sorted(done) == [a, b] and all(len(done[r].tokens) == 5 for r in (a, b))
