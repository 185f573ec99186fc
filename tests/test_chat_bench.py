"""The chat workload of `hwkv bench`: conversations through the engine with its prefix cache and a synthetic model's
attention (checked against hwkv.reference), hybrid vs all-full pools of one budget."""
import json
from dataclasses import replace

import pytest

from hwkv.bench import chat
from hwkv.bench.chat import PHASES, ChatWorkload, chat_sizes, run_chat, run_variant
from hwkv.engine.plan import round_up
from hwkv.engine.presets import ModelShape, get_preset, layer_pattern
from hwkv.errors import ConfigError, OutOfSlotsError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: the workload's tensors are small

GPT = get_preset("gpt-oss-20b")
# gpt-oss-like (SWA and full layers alternating, sinks), a small window and heads: pools of a few pages, fast
# priced in fp32 (4 bytes per element), the dtype SMALL runs in
TINY = ModelShape(name="tiny", layer_is_swa=layer_pattern(4, "sf"), window=16, num_heads=4, num_kv_heads=1,
                  head_dim=16, sinks=True, dtype_bytes=4)
SMALL = ChatWorkload(conversations=6, turns=3, system=64, user=48, reply=8, concurrency=3, memory=360_000,
                     page_size=8, chunk=64, dtype="fp32", check_every=4)


@pytest.fixture(scope="module")
def small():
    return run_chat(TINY, SMALL)


def _exact_all_full(w, shape=TINY):
    """Memory whose all-full pool holds exactly one longest turn (hwkv.engine.plan's rounding and padding page)."""
    return (round_up(w.context, w.page_size) + w.page_size) * shape.bytes_per_token_all_full


def test_chat_rows_add_up_fit_the_budget_and_are_checked(small):
    res = small
    assert [r.variant for r in res.rows] == ["hybrid", "all-full"]
    for r in res.rows:
        assert r.turns_done == SMALL.conversations * SMALL.turns
        assert r.prefill_tokens + r.reused_tokens == r.prompt_tokens
        assert r.hit_rate == pytest.approx(r.reused_tokens / r.prompt_tokens)
        assert r.generated_tokens == r.turns_done * SMALL.reply
        # every layer run: the pools allocate the bytes the budget planned, in the dtype run
        assert 0 < r.pool_bytes <= SMALL.memory and r.allocated_bytes == r.pool_bytes
        assert r.checked_forwards == -(-r.forwards // SMALL.check_every) and r.checked_requests >= r.checked_forwards
        assert r.max_err < 2e-3
        assert set(r.phase_ms) == set(PHASES) and r.phase_ms["attention"] > 0 and r.phase_ms["check"] > 0
        assert r.tokens_per_s > 0 and r.step_ms_median > 0
    hybrid, full = res.rows
    assert hybrid.full_pool_tokens > full.full_pool_tokens  # the SWA layers' share buys full-pool tokens
    assert hybrid.swa_pool_tokens > 0 and full.swa_pool_tokens == 0
    data = res.to_dict()
    assert data["schema"] == "hwkv-bench-chat/2" and data["layers_run"] == 4 and set(data["phases"]) == set(PHASES)
    # one untimed pass over a few conversations before either variant (compiles and first touches land there)
    assert data["warm_up"]["variant"] == "hybrid" and data["warm_up"]["conversations"] == SMALL.concurrency
    assert data["warm_up"]["turns"] == 2 and data["warm_up"]["wall_s"] > 0


def test_memory_bound_chat_reuses_more_with_the_hybrid_pools(small):
    """Histories outgrow the all-full pool; the hybrid pools keep more of them and their windows."""
    hybrid, full = small.rows
    assert full.evicted_full_tokens > 0
    assert hybrid.reused_tokens > full.reused_tokens


def test_the_phases_add_up_to_the_step(small):
    for r in small.rows:  # wall_s: the steps' time; phase_ms: means per step
        assert sum(r.phase_ms.values()) * r.forwards / 1e3 == pytest.approx(r.wall_s, abs=2e-3)


def test_every_step_keeps_the_engine_consistent_and_the_all_full_pools_mirrored():
    """Integrity after every step; the all-full variant holds an SWA slot for each full slot (nothing released)."""
    seen = []

    def hybrid_step(engine):
        engine.check_integrity()

    def mirrored_step(engine):
        engine.check_integrity()
        full, swa = engine.cache.held_slots()
        assert full == swa
        seen.append(full)

    hybrid, full = chat_sizes(TINY, SMALL)
    run_variant(hybrid, TINY, SMALL, on_step=hybrid_step)
    run_variant(full, TINY, SMALL, on_step=mirrored_step)
    assert max(seen) > 0


def test_model_shaped_layers_of_a_real_preset():
    """gpt-oss-20b's attention shapes (64 heads, 8 KV heads, sinks), its first two layers, a few turns."""
    w = ChatWorkload(conversations=2, turns=2, system=160, user=16, reply=4, concurrency=2, memory=64 << 20,
                     chunk=128, dtype="fp32", run_layers=2, check_every=2)
    res = run_chat(GPT, w)
    assert res.layers == 2
    for r in res.rows:
        assert r.turns_done == 4 and r.checked_forwards > 0 and r.max_err < 2e-3
        assert r.allocated_bytes < r.pool_bytes  # the budget is the model's; two of its 24 layers are allocated


def test_bad_workloads_are_refused():
    with pytest.raises(ConfigError, match="concurrency must be an integer >= 1, got 0"):
        ChatWorkload(concurrency=0)
    with pytest.raises(ConfigError, match="check_every must be an integer >= 0"):
        ChatWorkload(check_every=-1)
    with pytest.raises(ConfigError, match="dtype must be one of bf16, fp16, fp32, got 'int8'"):
        ChatWorkload(dtype="int8")
    with pytest.raises(ConfigError, match="raise --memory"):
        run_chat(GPT, ChatWorkload(memory=2**20))
    with pytest.raises(ConfigError, match=r"run_layers must be in \[1, 4\] for tiny, got 5"):
        run_chat(TINY, replace(SMALL, run_layers=5))
    full_first = replace(TINY, layer_is_swa=layer_pattern(4, "fs"))
    with pytest.raises(ConfigError, match=r"the first 1 layer\(s\) of tiny hold no SWA layer; its first is layer 1"):
        run_chat(full_first, replace(SMALL, run_layers=1))
    with pytest.raises(ConfigError, match="no SWA layers"):
        run_chat(replace(TINY, layer_is_swa=(False,) * 4), SMALL)


def test_a_turn_larger_than_the_pools_is_refused_before_anything_runs(monkeypatch):
    ran = []
    monkeypatch.setattr(chat, "run_variant", lambda *a, **k: ran.append(a))
    w = replace(SMALL, system=512, memory=_exact_all_full(replace(SMALL, system=512)) - 1)
    assert chat_sizes(TINY, w)[0].size > 680  # the hybrid pools hold it
    with pytest.raises(OutOfSlotsError, match=r"\(all-full\): a turn of 680 tokens \(system 512 \+ 3 x \(user 48 \+ "
                                              r"reply 8\)\) needs 680 slots; the pool has 672"):
        run_chat(TINY, w)
    assert ran == []


def test_the_hybrid_pools_are_checked_for_the_longest_turn():
    w = replace(SMALL, memory=1)
    hybrid, _ = chat_sizes(TINY, SMALL)
    # SWA: its own window, round_up(16 + 8 + 8, 8) = 32, and its lock's, round_up(16, 8) + 8 = 24; a chunk of 64
    fits = replace(hybrid, size=232, size_swa=32 + 24 + 64)
    chat._check_fits(fits, TINY, w)
    with pytest.raises(OutOfSlotsError, match=r"\(hybrid\): a turn of 232 tokens .* needs 232 full-pool slots and "
                                              r"56 SWA slots beside a prefill chunk of 64; the pools have 224 full / "
                                              r"120 SWA"):
        chat._check_fits(replace(fits, size=224), TINY, w)
    with pytest.raises(OutOfSlotsError, match=r"the pools have 232 full / 112 SWA"):
        chat._check_fits(replace(fits, size_swa=112), TINY, w)


@pytest.mark.parametrize("concurrency", [1, 3])
def test_an_all_full_pool_of_exactly_the_longest_turn_finishes_every_turn(concurrency):
    """Every turn runs to its end in a pool that holds one longest turn: the engine admits a turn only when its
    whole context fits beside the running ones' (evicting cached conversations for it)."""
    w = replace(SMALL, concurrency=concurrency, memory=_exact_all_full(SMALL), check_every=0)
    size = round_up(w.context, w.page_size)
    full = chat._Sizes("all-full", size, size, w.memory, True)
    chat._check_fits(full, TINY, w)
    row = run_variant(full, TINY, w)
    assert row.turns_done == w.conversations * w.turns and row.evicted_full_tokens > 0


def test_cli_chat_workload_json(capsys):
    from hwkv.cli import main

    code = main(["bench", "--workload", "chat", "--device", "cpu", "--model", "gpt-oss-20b", "--run-layers", "2",
                 "--conversations", "3", "--turns", "2", "--system-len", "160", "--user-len", "16", "--reply-len",
                 "4", "--concurrency", "2", "--memory", "128MiB", "--chunk", "128", "--check-every", "3", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    data = json.loads(out.out)
    assert data["schema"] == "hwkv-bench-chat/2" and [r["variant"] for r in data["rows"]] == ["hybrid", "all-full"]
    assert data["layers_run"] == 2 and data["workload"]["check_every"] == 3 and data["workload"]["dtype"] == "fp32"
    assert all(r["turns_done"] == 6 and r["checked_forwards"] > 0 for r in data["rows"])
    assert main(["bench", "--workload", "chat", "--device", "cpu", "--memory", "1MiB"]) == 2
    assert main(["bench", "--workload", "chat", "--device", "cpu", "--steps", "4", "--quick"]) == 2
    assert "--steps, --quick: the decode workload's; --workload chat does not read them" in capsys.readouterr().err


def test_cli_chat_table(capsys):
    from hwkv.cli import main

    code = main(["bench", "--workload", "chat", "--device", "cpu", "--run-layers", "2", "--conversations", "2",
                 "--turns", "2", "--system-len", "160", "--user-len", "16", "--reply-len", "4", "--memory", "128MiB",
                 "--check-every", "0"])
    out = capsys.readouterr().out
    assert code == 0
    assert "on cpu, 1 thread(s): gpt-oss-20b (2 of 24 layers run, fp32)" in out
    assert "| hybrid |" in out and "| all-full |" in out and "prefill tokens saved by the cache" in out
    assert all(f"| {name} |" in out for name in PHASES) and "reference check: off (--check-every 0)" in out


def test_cli_refuses_a_turn_that_never_fits_before_running(capsys, monkeypatch):
    """160 MiB of gpt-oss-20b KV in fp32 give the hybrid pools 1856 full-pool tokens, the last turn has 1952: said at
    once, in one line naming both, exit code 2, nothing run."""
    from hwkv.cli import main

    ran = []
    monkeypatch.setattr(chat, "run_variant", lambda *a, **k: ran.append(a))
    args = ["bench", "--workload", "chat", "--device", "cpu", "--conversations", "6", "--turns", "5",
            "--system-len", "512", "--user-len", "256", "--reply-len", "32", "--concurrency", "1",
            "--memory", "160MiB", "--page-size", "16", "--chunk", "256"]
    code = main(args)
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and ran == []
    assert len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err
    assert "(hybrid)" in out.err and "1952 tokens" in out.err and "needs 1952 full-pool slots" in out.err
    assert "the pools have 1856 full / 1520 SWA" in out.err


def _buffer_bytes(cache):
    pool = cache.pool
    groups = [pool.full_kv_pool, pool.swa_kv_pool] if hasattr(pool, "full_kv_pool") else [pool]
    return sum(b.numel() * b.element_size() for g in groups for b in (*g.k_buffer, *g.v_buffer))


def test_the_pools_are_priced_in_the_dtype_the_workload_runs():
    """A shape priced at bf16's 2 bytes per element (as every preset is) run in fp32: the pools hold half the tokens
    bf16's would, and what every layer allocates is the pool_bytes the budget claims (it had been twice that)."""
    import torch

    bf16_shape = replace(TINY, dtype_bytes=2)
    fp32 = chat_sizes(bf16_shape, SMALL)
    assert fp32 == chat_sizes(TINY, SMALL)  # --dtype fp32 and --kv-dtype fp32 size the same pools
    bf16 = chat_sizes(bf16_shape, replace(SMALL, dtype="bf16"))
    assert bf16[1].size > 1.9 * fp32[1].size
    for w, sizes in ((SMALL, fp32), (replace(SMALL, dtype="bf16"), bf16)):
        for s in sizes:
            cache = chat._build(s, chat.run_shape(bf16_shape, w), w, torch.device("cpu"), "cpu")
            assert _buffer_bytes(cache) == s.pool_bytes <= w.memory, (w.dtype, s)


def test_cli_dtype_fp32_and_kv_dtype_fp32_size_the_same_pools(capsys, monkeypatch):
    """On the CPU (fp32) the default budget is 300 MiB: the pools the 150 MiB default held when they were priced at
    bf16; --kv-dtype fp32 (which had left no full pool) sizes the same pools as --dtype fp32."""
    from hwkv.cli import main

    seen = []

    def stop(s, *a, **k):
        seen.append(s)
        raise ConfigError("stopped before the run")

    monkeypatch.setattr(chat, "run_variant", stop)
    for flag in ("--dtype", "--kv-dtype"):
        assert main(["bench", "--workload", "chat", "--device", "cpu", flag, "fp32"]) == 2
        assert "stopped before the run" in capsys.readouterr().err
    assert len(seen) == 2 and seen[0] == seen[1]
    assert (seen[0].size, seen[0].size_swa, seen[0].pool_bytes) == (4240, 2128, 300 * 2**20)
