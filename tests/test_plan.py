"""`hwkv plan`: pool sizes against hand computation, the closed-form saving, the CLI and its JSON."""
from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings, strategies as st

from hwkv.bench.plan_cli import add_plan_arguments, add_plan_parser, run_plan
from hwkv.engine.plan import cache_lock_tokens, parse_bytes, plan, swa_tokens_per_request
from hwkv.engine.presets import PRESETS, custom_shape
from hwkv.errors import ConfigError

GiB = 2**30


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1234", 1234), (1234, 1234),
    (" 80 gib ", 80 * 2**30), ("1.5TiB", 3 * 2**39), ("4KB", 4000), ("7B", 7),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["80G", "abc", "", "-5GiB", "0", "GiB", "80 GiBs", "1e9", True])
def test_parse_bytes_rejects_bad_values_by_name(bad):
    with pytest.raises(ConfigError, match=repr(bad).replace("(", r"\(")):
        parse_bytes(bad)


def test_swa_tokens_per_request():
    assert swa_tokens_per_request(1024, 16, 1) == 1024 + 16 + 16 == 1056   # window + margin page + partial page
    assert swa_tokens_per_request(128, 16, 1) == 160
    assert swa_tokens_per_request(100, 16, 1) == 144                       # ceil(100/16)=7 pages + 2
    assert swa_tokens_per_request(128, 1, 1) == 130
    assert swa_tokens_per_request(128, 16, 0) == 144


def test_gemma_3_27b_at_80gib_32k_by_hand():
    r = plan(PRESETS["gemma-3-27b"], 80 * GiB, 32768)
    mem = 80 * 2**30                                    # 85899345920
    full_b, swa_b = 81920, 425984                       # 10 and 52 layers x 8192 bytes per token
    per_request = 32768 * full_b + 1056 * swa_b         # 2684354560 + 449839104 = 3134193664
    fixed = 16 * full_b + (8192 + 16) * swa_b           # padding rows + chunk reserve = 3497787392
    assert per_request == 3134193664 and fixed == 3497787392
    assert r.max_running == (mem - fixed) // per_request == 26
    assert r.swa_pool_tokens == 26 * 1056 + 8192 == 35648
    assert r.swa_pool_bytes == (35648 + 16) * swa_b == 15192293376
    # (85899345920 - 15192293376) // 81920 = 863123; minus the 16 padding rows, down to a page: 863104
    assert r.full_pool_tokens == 863104 and r.full_pool_bytes == (863104 + 16) * full_b
    assert r.max_concurrent_requests == 26              # 863104 // 32768 = 26, (35648 - 8192) // 1056 = 26
    # all-full: 85899345920 // 507904 = 169125 - 16 -> 169104 tokens, 5 requests of 32768
    assert (r.all_full_pool_tokens, r.all_full_requests) == (169104, 5)
    assert r.saving_requests == pytest.approx(26 / 5)
    assert r.saving_bytes_per_request == pytest.approx(32768 * 507904 / per_request)   # 5.3101
    assert 0 <= r.unused_bytes < 16 * full_b + full_b


def test_gemma_3_27b_32k_saving_within_2_percent_of_closed_form():
    shape = PRESETS["gemma-3-27b"]
    limit = 62 * 32768 / (10 * 32768 + 52 * 1024)       # 5.333
    assert limit == pytest.approx(5.333, abs=1e-3)
    r = plan(shape, 80 * GiB, 32768)
    assert r.saving_limit == pytest.approx(limit)
    assert r.saving_bytes_per_request == pytest.approx(limit, rel=0.02)
    big = plan(shape, 4 * 2**40, 32768)                 # request counts converge once they are large
    assert big.saving_requests == pytest.approx(limit, rel=0.02)


def test_gpt_oss_120b_at_80gib_128k_by_hand():
    r = plan(PRESETS["gpt-oss-120b"], 80 * GiB, 131072)
    b = 36864                                           # 18 layers x 8 x 128 x 2, both groups
    per_request = 131072 * b + 160 * b                  # 4837736448
    fixed = 16 * b + (8192 + 16) * b                    # 303169536
    assert r.max_running == (85899345920 - fixed) // per_request == 17
    assert r.swa_pool_tokens == 17 * 160 + 8192 == 10912
    assert r.swa_pool_bytes == (10912 + 16) * b == 402849792
    # (85899345920 - 402849792) // 36864 = 2319240; - 16 = 2319224; down to a page: 2319216
    assert r.full_pool_tokens == 2319216 and r.max_concurrent_requests == 17
    # all-full: 85899345920 // 73728 = 1165084; - 16 -> 1165056 tokens, 8 requests
    assert (r.all_full_pool_tokens, r.all_full_requests) == (1165056, 8)
    assert r.saving_requests == pytest.approx(17 / 8)
    assert r.saving_bytes_per_request == pytest.approx(131072 * 73728 / per_request)


def test_max_running_fixes_the_swa_pool_and_the_full_pool_takes_the_rest():
    r = plan(PRESETS["gemma-3-27b"], 80 * GiB, 32768, max_running=10)
    assert r.swa_pool_tokens == 10 * 1056 + 8192 == 18752
    assert r.swa_pool_bytes == 18768 * 425984 == 7994867712
    # (85899345920 - 7994867712) // 81920 = 950982; - 16 -> 950966; down to a page: 950960
    assert r.full_pool_tokens == 950960 and r.max_concurrent_requests == 10


def test_not_enough_memory_names_needed_and_given():
    with pytest.raises(ConfigError, match=r"need 27023376384 bytes .* given 1073741824"):
        plan(PRESETS["gemma-2-27b"], 1 * GiB, 131072)
    with pytest.raises(ConfigError, match=r"27 request\(s\).*at most 26 fit"):
        plan(PRESETS["gemma-3-27b"], 80 * GiB, 32768, max_running=27)


@pytest.mark.parametrize("kwargs", [dict(context=0), dict(page_size=0), dict(chunk=0),
                                    dict(eviction_margin_pages=-1), dict(max_running=0)])
def test_bad_plan_arguments(kwargs):
    args = dict(shape=PRESETS["gpt-oss-20b"], memory_bytes=80 * GiB, context=4096) | kwargs
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        plan(**args)


def test_model_without_swa_layers_saves_nothing():
    dense = custom_shape(layers=4, window=1, heads=8, kv_heads=8, head_dim=64, full_every=1)
    r = plan(dense, 1 * GiB, 4096)
    assert r.swa_pool_tokens == 0 and r.swa_pool_bytes == 0
    assert r.saving_bytes_per_request == 1.0 and r.max_concurrent_requests == r.all_full_requests


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(PRESETS)), gib=st.integers(8, 2048), context=st.integers(1, 300_000),
       page_size=st.sampled_from([1, 16, 64, 256]), chunk=st.integers(1, 16384))
def test_plan_invariants(name, gib, context, page_size, chunk):
    shape = PRESETS[name]
    try:
        r = plan(shape, gib * GiB, context, page_size=page_size, chunk=chunk)
    except ConfigError:
        return
    assert r.full_pool_bytes + r.swa_pool_bytes <= r.memory_bytes
    assert r.full_pool_tokens % page_size == 0 and r.swa_pool_tokens % page_size == 0
    assert r.max_concurrent_requests >= r.max_running >= 1
    assert r.max_concurrent_requests * r.full_tokens_per_request <= r.full_pool_tokens
    assert r.saving_bytes_per_request <= r.saving_limit + 1e-9
    assert 0 <= r.unused_bytes < (page_size + 1) * r.full_bytes_per_token   # the full pool takes the rest


def _run(capsys, *argv: str):
    parser = argparse.ArgumentParser(prog="hwkv")
    add_plan_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_schema(capsys):
    rc, out, _ = _run(capsys, "--model", "gemma-3-27b", "--memory", "80GiB", "--context", "32768", "--json",
                      "--no-prefix-cache")  # the hand computation's plan
    assert rc == 0
    d = json.loads(out)
    ints = {"memory_bytes", "context", "page_size", "chunk", "eviction_margin_pages", "full_bytes_per_token",
            "swa_bytes_per_token", "all_full_bytes_per_token", "full_tokens_per_request", "swa_tokens_per_request",
            "chunk_reserve_tokens", "max_running", "full_pool_tokens", "full_pool_bytes", "swa_pool_tokens",
            "swa_pool_bytes", "max_concurrent_requests", "all_full_pool_tokens", "all_full_pool_bytes",
            "all_full_requests", "unused_bytes"}
    floats = {"saving_requests", "saving_bytes_per_request", "saving_limit"}
    assert set(d) == ints | floats | {"schema", "model", "prefix_cache"} and d["prefix_cache"] is False
    assert d["schema"] == "hwkv-plan/1" and d["model"] == "gemma-3-27b"
    assert all(type(d[k]) is int for k in ints) and all(isinstance(d[k], float) for k in floats)
    assert (d["max_concurrent_requests"], d["all_full_requests"], d["full_pool_tokens"]) == (26, 5, 863104)


def test_cli_table_and_custom_shape(capsys):
    rc, out, _ = _run(capsys, "--layers", "8", "--window", "64", "--heads", "8", "--kv-heads", "2",
                      "--head-dim", "64", "--pattern", "sssf", "--memory", "512MiB", "--context", "4096",
                      "--page-size", "1", "--chunk", "512")
    assert rc == 0 and "max concurrent" in out and "custom" in out


def test_cli_bad_memory_is_an_error_not_a_traceback(capsys):
    rc, out, err = _run(capsys, "--model", "gpt-oss-20b", "--memory", "80G", "--context", "1024")
    assert rc == 2 and out == "" and "'80G'" in err


def test_registry_form_add_arguments_then_run(capsys):
    parser = argparse.ArgumentParser(prog="hwkv")
    add_plan_arguments(parser.add_subparsers(dest="command").add_parser("plan"))
    args = parser.parse_args(["plan", "--model", "gpt-oss-120b", "--memory", "80GiB", "--context", "131072", "--json"])
    assert run_plan(args) == 0 and json.loads(capsys.readouterr().out)["max_concurrent_requests"] == 17


# ------------------------------------------------- short contexts: a request's SWA share is its context


def test_short_context_plans_as_many_requests_as_all_full_within_the_chunk_reserve():
    """gemma-3-27b at context 512 (W = 1024) in 80 GiB: each request holds 512 SWA slots, not W + 2 pages."""
    r = plan(PRESETS["gemma-3-27b"], 80 * GiB, 512)
    full_b, swa_b, all_b = 81920, 425984, 507904
    assert r.swa_tokens_per_request == r.full_tokens_per_request == 512
    per_request = 512 * all_b                           # 260046848: the same bytes as all-full
    fixed = 16 * full_b + (8192 + 16) * swa_b           # padding rows + the chunk reserve
    assert r.max_running == (80 * GiB - fixed) // per_request == 316
    assert r.all_full_requests == 330                   # (the old plan: 167, "saving 0.51x")
    chunk_share = -(-(8192 + 16) * swa_b // per_request)  # requests the chunk reserve costs: 14
    assert r.all_full_requests - chunk_share <= r.max_concurrent_requests <= r.all_full_requests
    assert r.saving_bytes_per_request == 1.0 == r.saving_limit


def test_huge_window_at_a_short_context_is_not_a_0_02x_plan():
    shape = custom_shape(layers=4, window=100_000, heads=8, kv_heads=8, head_dim=64, full_every=2)
    r = plan(shape, 8 * GiB, 1000, chunk=512)
    assert r.swa_tokens_per_request == 1008 == r.full_tokens_per_request
    assert r.max_concurrent_requests >= r.all_full_requests - 1 and r.saving_requests >= 0.99


@pytest.mark.parametrize("context, expected", [(1, 16), (512, 512), (1000, 1008), (1024, 1024), (1025, 1040),
                                               (1040, 1040), (1041, 1056), (32768, 1056)])
def test_swa_share_is_the_context_up_to_the_window_bound(context, expected):
    assert swa_tokens_per_request(1024, 16, 1, context) == expected
    assert swa_tokens_per_request(1024, 16, 1) == 1056   # without a context: the window bound, as before


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(PRESETS)), gib=st.integers(8, 512), frac=st.floats(0.001, 1.0),
       page_size=st.sampled_from([1, 16, 64]), chunk=st.integers(1, 16384))
def test_contexts_within_the_window_lose_only_the_chunk_reserve(name, gib, frac, page_size, chunk):
    shape = PRESETS[name]
    context = max(1, int(shape.window * frac))
    try:
        r = plan(shape, gib * GiB, context, page_size=page_size, chunk=chunk)
    except ConfigError:
        return
    per_request = r.full_tokens_per_request * r.all_full_bytes_per_token
    chunk_share = -(-(r.chunk_reserve_tokens + page_size) * r.swa_bytes_per_token // per_request)
    assert r.max_concurrent_requests >= r.all_full_requests - chunk_share - 1
    assert r.saving_bytes_per_request == pytest.approx(1.0)


@pytest.mark.parametrize("context, max_new", [(512, 64), (40, 8), (4096, 512)])
def test_the_scheduler_admits_every_request_the_plan_sized_for(context, max_new):
    """The runner sizes its pools through plan() and the scheduler reserves min(round_up(kv, P), window
    bound) SWA pages per request: every one of max_running requests of the full context is admitted at once."""
    from hwkv.integrations.hf_model import PoolPlan
    from hwkv.integrations.sampling import SamplingParams
    from hwkv.integrations.scheduler import Request, Scheduler

    shape = PRESETS["gemma-3-27b"]
    r = plan(shape, 20 * GiB, context, chunk=512)
    pool_plan = PoolPlan(r.full_pool_tokens, r.swa_pool_tokens, r.page_size, context, r.max_running, r.chunk,
                         r.full_bytes_per_token, r.swa_bytes_per_token, r.memory_bytes)
    sched = Scheduler(pool_plan, shape.window)
    params = SamplingParams(max_new_tokens=max_new, seed=0)
    for i in range(r.max_running):
        sched.add(Request(i, list(range(context - max_new + 1)), params))
    admitted = sched.admit()
    assert len(admitted) == r.max_running and not sched.waiting
    for row, req in enumerate(admitted):  # the runner gives each its request row
        req.row = row
    sched.check_integrity(r.max_running)
    assert sched.reserved_swa <= sched.swa_capacity and sched.reserved_full <= sched.full_capacity


# ------------------------------------------------- the prefix cache: `hwkv plan` plans as generate runs


def test_cli_plans_with_the_prefix_cache_as_generate_and_the_runner_do(capsys, monkeypatch):
    """By default `hwkv generate` and HybridRunner keep a prefix cache, whose lock pins a window per request in the
    SWA pool: `hwkv plan` sizes the pools the same way unless --no-prefix-cache, and says which it did."""
    import torch

    from hwkv.engine.pools import plan_pools

    shape = PRESETS["gpt-oss-20b"]
    argv = ("--model", "gpt-oss-20b", "--memory", "8GiB", "--context", "4096", "--chunk", "512")
    engine = plan_pools(shape, context=4096, max_running=10**6, chunk=512, page_size=16, memory=8 * GiB,
                        device=torch.device("meta"), prefix_cache=True)
    rc, out, _ = _run(capsys, *argv, "--json")
    d = json.loads(out)
    assert rc == 0 and d["prefix_cache"] is True
    assert (d["max_running"], d["full_pool_tokens"], d["swa_pool_tokens"]) == (engine.max_running, engine.size,
                                                                               engine.size_swa)
    assert d["swa_tokens_per_request"] == swa_tokens_per_request(128, 16) + cache_lock_tokens(128, 16, 4096)
    rc, out, _ = _run(capsys, *argv, "--no-prefix-cache", "--json")
    off = plan(shape, 8 * GiB, 4096, chunk=512)
    d = json.loads(out)
    assert rc == 0 and d["prefix_cache"] is False and d["max_running"] == off.max_running > engine.max_running
    monkeypatch.setenv("COLUMNS", "200")  # rich's table on one line per row
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0 and "prefix cache on" in out and "cache lock" in out
    rc, out, _ = _run(capsys, *argv, "--no-prefix-cache")
    assert rc == 0 and "prefix cache off" in out and "cache lock" not in out
