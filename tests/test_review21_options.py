"""Review 21 (B): options the sizing rules refuse, refused by every entry that takes them, before anything changes.

- `plan_pools`, `HybridRunner` and `Engine` refuse what `hwkv.engine.plan.plan` refuses, with its wording: a bool
  size (True read as 1), a switch that is not True/False (None where it means "decide": "no" read as on). The runner
  refuses before the model's attention is swapped, the engine before it takes a request row.
- Context parallelism: `cp_plan` refuses a dtype= that is no floating torch dtype, a pool= that is no KV pool, a
  check_ranks= that is no switch, on every rank when one rank has it; a group= that is no process group is a typed
  error. `cp_allgather_and_save_kv` refuses a shards= that is no CPShards, a layer that is no AttentionLayer and a
  pool that is none (the plan-less call: on every rank, before its K/V gather). One spawn of 2 gloo ranks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from hwkv.distributed import cp_allgather_and_save_kv, cp_plan
from hwkv.engine.engine import Engine as StepEngine
from hwkv.engine.plan import plan
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.presets import ModelShape, layer_pattern
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ConfigError

from test_distributed_refusals import Engine, kv, raised, same_everywhere, spawn  # noqa: E402  (the CP tests' pool setup)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

CPU = torch.device("cpu")
SHAPE = ModelShape(name="t", layer_is_swa=layer_pattern(2, "sf"), window=8, num_heads=2, num_kv_heads=1,
                   head_dim=8, dtype_bytes=4)
SIZES = dict(context=32, max_running=2, chunk=8, page_size=4)


def _refusal(call: Any) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


# ---- finding 1: plan_pools, the engine, the runner ----------------------------------------------------------

@pytest.mark.parametrize("name, value", [("max_running", True), ("chunk", True), ("page_size", True),
                                         ("context", True), ("prefix_cache", "no"), ("prefix_cache", 1)])
def test_plan_pools_refuses_what_plan_refuses_in_its_words(name: str, value: object) -> None:
    kw = {**SIZES, name: value}
    # a budget no machine has: the option is refused before the budget is compared with the free memory
    got = _refusal(lambda: plan_pools(SHAPE, **kw, memory=2**60, device=CPU))
    context = kw.pop("context")
    want = _refusal(lambda: plan(SHAPE, 2**22, context, **kw))
    if name == "max_running":  # plan's max_running may be None ("as many as fit"); plan_pools' may not
        want = want.replace(" or None", "")
    accepted = "True or False" if name == "prefix_cache" else "an integer >= 1"
    assert got == want == f"{name} must be {accepted}, got {value!r}"


def test_engine_refuses_switches_before_taking_a_row() -> None:
    pools = plan_pools(SHAPE, **SIZES, memory=None, device=CPU)
    cache = build_cache(SHAPE, pools, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(SHAPE, cache.backend, vocab_size=50, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    rows = cache.rtt.available_size()
    cases = {"overlap": ("no", "overlap must be True, False or None, got 'no'"),
             "prefix_cache": ("no", "prefix_cache must be True or False, got 'no'"),
             "whole_step": ("yes", "whole_step must be True, False or None, got 'yes'")}
    for name, (value, message) in cases.items():
        kw = {"overlap": False, name: value}
        assert _refusal(lambda: StepEngine(cache, model, stats=RunnerStats(SHAPE, pools), vocab_size=50, window=8,
                                           **kw)) == message
        assert cache.rtt.available_size() == rows, name  # the padding row was not taken
    StepEngine(cache, model, stats=RunnerStats(SHAPE, pools), vocab_size=50, window=8, overlap=False,
               prefix_cache=False, whole_step=None)  # True/False/None are taken


def test_runner_refuses_bad_options_before_swapping_the_model_attention() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")
    from hwkv.integrations import runner
    from hwkv.integrations.transformers import HybridRunner

    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=256, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    swaps: List[str] = []
    swap = model.set_attn_implementation
    model.set_attn_implementation = lambda impl: (swaps.append(impl), swap(impl))[1]
    before = model.config._attn_implementation
    cases = [("max_running", True, "max_running must be an integer >= 1, got True"),
             ("chunk", True, "chunk must be an integer >= 1, got True"),
             ("page_size", True, "page_size must be an integer >= 1, got True"),
             ("prefix_cache", "no", "prefix_cache must be True or False, got 'no'"),
             ("overlap", "no", "overlap must be True, False or None, got 'no'"),
             ("whole_step", "yes", "whole_step must be True, False or None, got 'yes'")]
    for name, value, message in cases:
        assert _refusal(lambda: HybridRunner(model, graphs="off", context=32, **{name: value})) == message
        assert swaps == [] and model.config._attn_implementation == before, name
        assert model not in runner._OPEN, name
    with HybridRunner(model, graphs="off", context=32, prefix_cache=False, overlap=False, whole_step=None) as r:
        assert r.prefix is None
    assert model.config._attn_implementation == before


# ---- findings 2 and 3 and the nits: context parallelism ------------------------------------------------------

def job_cp(rank: int) -> Dict[str, object]:
    """Rank 1 alone passes the bad value where the plan's (or the plan-less call's) agreement carries it; both
    ranks where the refusal is local (no agreement to carry it: group=, shards=)."""
    eng = Engine()
    wl, bad = eng.write_loc, rank == 1
    before = eng.snapshot()
    out: Dict[str, object] = {}
    for name, dtype in (("dtype str", "float32"), ("dtype int", 5), ("dtype int64", torch.int64)):
        out[name] = raised(lambda: cp_plan(wl, pool=eng.pool, dtype=dtype if bad else None))
    out["pool"] = raised(lambda: cp_plan(wl, pool=object() if bad else eng.pool))
    out["check_ranks"] = raised(lambda: cp_plan(wl, pool=eng.pool, check_ranks="no" if bad else None))
    out["group"] = raised(lambda: cp_plan(wl, group=5))
    layer = eng.layers[0]
    k, v = kv(layer)
    shards = cp_plan(wl, pool=eng.pool, dtype=torch.float32)
    ks, vs = k[shards.local_slice], v[shards.local_slice]
    out["shards"] = raised(lambda: cp_allgather_and_save_kv(eng.pool, layer, wl, ks, vs, shards="x"))
    out["save check_ranks"] = raised(lambda: cp_allgather_and_save_kv(eng.pool, layer, wl, ks, vs, shards=shards,
                                                                      check_ranks="no"))
    out["layer"] = raised(lambda: cp_allgather_and_save_kv(eng.pool, "x" if bad else layer, wl, ks, vs,
                                                           shards=shards, check_ranks=True))
    out["pool None"] = raised(lambda: cp_allgather_and_save_kv(None if bad else eng.pool, layer, wl, ks, vs))
    out["unchanged"] = eng.same(before)
    k_full, v_full = cp_allgather_and_save_kv(eng.pool, layer, wl, ks, vs, shards=shards)  # still in step
    out["then"] = torch.equal(k_full, k) and torch.equal(v_full, v)
    return out


def test_cp_refuses_bad_arguments_typed_and_on_every_rank(tmp_path: Path) -> None:
    results = spawn("test_review21_options:job_cp", tmp_path, deadline_s=60)
    dtype = r"rank 1: cp_plan: dtype= must be a floating torch dtype \(every layer's k and v\), got "
    same_everywhere(results, "dtype str", "ConfigError", dtype + "'float32'$")
    same_everywhere(results, "dtype int", "ConfigError", dtype + "5$")
    same_everywhere(results, "dtype int64", "ConfigError", dtype + r"torch\.int64$")
    same_everywhere(results, "pool", "ConfigError", r"^rank 1: pool= must be a KV pool \(an SWAKVPool or "
                                                    r"MHATokenToKVPool: the pool the layers write\), got object$")
    same_everywhere(results, "check_ranks", "ConfigError",
                    r"^rank 1: cp_plan: check_ranks must be True, False or None, got 'no'$")
    same_everywhere(results, "group", "ConfigError", r"^group=5 is not a process group of this process: pass None")
    same_everywhere(results, "shards", "ConfigError",
                    r"^shards= must be this forward's CPShards \(cp_plan's\) or None .*, got str$")
    same_everywhere(results, "save check_ranks", "ConfigError", r"^check_ranks must be True, False or None, got 'no'$")
    same_everywhere(results, "layer", "ConfigError",
                    r"^rank 1: layer must be an hwkv\.layer\.AttentionLayer \(.*\), got str$")
    same_everywhere(results, "pool None", "ConfigError", r"^rank 1: pool= must be a KV pool .*, got NoneType$")
    assert all(r["unchanged"] and r["then"] for r in results), results
