"""The chat workload of `hwkv bench` (prefix cache over hybrid vs all-full pools of one budget)."""
import pytest

from hwkv.bench.chat import ChatWorkload, run_chat
from hwkv.bench.presets import get_preset
from hwkv.errors import ConfigError

SMALL = ChatWorkload(conversations=12, turns=3, system=512, user=64, reply=32, concurrency=4,
                     memory=160 * 2**20, page_size=16, chunk=256)


def test_chat_rows_add_up_and_fit_the_budget():
    shape = get_preset("gpt-oss-20b")
    res = run_chat(shape, SMALL)
    assert [r.variant for r in res.rows] == ["hybrid", "all-full"]
    for r in res.rows:
        assert r.turns_done == SMALL.conversations * SMALL.turns
        assert r.prefill_tokens + r.reused_tokens == r.prompt_tokens
        assert r.hit_rate == pytest.approx(r.reused_tokens / r.prompt_tokens)
        assert 0 < r.pool_bytes <= SMALL.memory
    hybrid, full = res.rows
    assert hybrid.full_pool_tokens > full.full_pool_tokens  # the SWA layers' share buys full-pool tokens
    assert hybrid.swa_pool_tokens > 0 and full.swa_pool_tokens == 0
    assert res.to_dict()["schema"] == "hwkv-bench-chat/1"


def test_memory_bound_chat_reuses_more_with_the_hybrid_pools():
    """Histories outgrow the all-full pool; the hybrid pools keep more of them and their windows."""
    res = run_chat(get_preset("gpt-oss-20b"), SMALL)
    hybrid, full = res.rows
    assert full.evicted_full_tokens > 0
    assert hybrid.reused_tokens > full.reused_tokens


def test_bad_workloads_are_refused():
    with pytest.raises(ConfigError, match="concurrency"):
        ChatWorkload(concurrency=0)
    with pytest.raises(ConfigError, match="raise --memory"):
        run_chat(get_preset("gpt-oss-20b"), ChatWorkload(memory=2**20))


def test_cli_chat_workload_json(capsys):
    import json

    from hwkv.cli import main

    code = main(["bench", "--workload", "chat", "--device", "cpu", "--conversations", "6", "--turns", "2",
                 "--system-len", "256", "--user-len", "32", "--reply-len", "16", "--concurrency", "2",
                 "--memory", "64MiB", "--chunk", "128", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    data = json.loads(out.out)
    assert data["schema"] == "hwkv-bench-chat/1" and [r["variant"] for r in data["rows"]] == ["hybrid", "all-full"]
    assert all(r["turns_done"] == 12 for r in data["rows"])
    assert main(["bench", "--workload", "chat", "--device", "cpu", "--memory", "1MiB"]) == 2
