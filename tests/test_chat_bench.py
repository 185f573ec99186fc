"""The chat workload of `hwkv bench` (prefix cache over hybrid vs all-full pools of one budget)."""
import pytest

from hwkv.bench.chat import ChatWorkload, run_chat
from hwkv.engine.plan import round_up
from hwkv.engine.presets import ModelShape, get_preset, layer_pattern
from hwkv.errors import ConfigError, OutOfSlotsError

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


# ---- issue 21: admission by reservation, matches acquired before anything is evicted ----------------------------
GPT = get_preset("gpt-oss-20b")
REPRO = dict(conversations=6, turns=5, system=256, user=256, reply=32, page_size=16, chunk=256)  # the commands


class _Order:
    """Records the workload's own calls into the cache (not the cache's calls into itself), in order."""

    def __init__(self, monkeypatch):
        import hwkv.bench.chat as chat
        from hwkv.cache import HybridPrefixCache

        self.events, depth = [], [0]

        def wrap(name):
            f = getattr(HybridPrefixCache, name)

            def call(cache, *a, **k):
                if depth[0] == 0:
                    self.events.append(name)
                depth[0] += 1
                try:
                    return f(cache, *a, **k)
                finally:
                    depth[0] -= 1
            return call

        recording = type("RecordingCache", (HybridPrefixCache,),
                         {n: wrap(n) for n in ("match_prefix", "acquire", "evict", "evict_swa", "cache_running")})
        monkeypatch.setattr(chat, "HybridPrefixCache", recording)


@pytest.mark.parametrize("w", [SMALL, ChatWorkload(conversations=2, turns=3, system=256, user=100, reply=100,
                                                   concurrency=1, memory=62540447, page_size=16, chunk=100)],
                         ids=["small", "stale-before"])
def test_a_match_is_acquired_before_anything_is_evicted(monkeypatch, w):
    """match_prefix, then evicting to make room, then acquire copied freed (or changed) locs into the row: the
    workload must acquire what it matched with no eviction in between (the second workload's match went stale)."""
    order = _Order(monkeypatch)
    res = run_chat(GPT, w)
    assert all(r.turns_done == w.conversations * w.turns for r in res.rows)
    ev = order.events
    assert "evict" in ev and ev.count("acquire") == sum(r.turns_done for r in res.rows)
    for i, e in enumerate(ev):
        if e == "acquire":
            since = ev[max(j for j in range(i) if ev[j] == "match_prefix"):i]
            assert not {"evict", "evict_swa"} & set(since), f"evicted between a match and its acquire: {since}"


def _all_full_exact(w):
    """Memory whose all-full pool holds exactly one longest turn (hwkv.engine.plan's rounding and padding page)."""
    return (round_up(w.context, w.page_size) + w.page_size) * GPT.bytes_per_token_all_full


@pytest.mark.parametrize("concurrency,memory", [(3, 178 * 2**20), (1, None)], ids=["issue-3-at-178MiB", "exact-pool"])
def test_admitted_turns_always_finish(concurrency, memory):
    """The issue's run at concurrency 3 ended with "3 running turns need 96 more slots": a forward asked for a
    page more per turn than it allocates. Admission reserves each turn's worst case and a forward asks for the
    pages it takes, so every turn finishes, also in an all-full pool that holds exactly the longest turn."""
    w = ChatWorkload(**REPRO, concurrency=concurrency, memory=1)
    w = ChatWorkload(**REPRO, concurrency=concurrency, memory=memory or _all_full_exact(w))
    res = run_chat(GPT, w)
    assert all(r.turns_done == 30 for r in res.rows)
    if memory is None:
        assert res.rows[1].full_pool_tokens == round_up(w.context, w.page_size)


def _tiny(window):
    """gpt-oss-like (SWA and full layers alternating), with a small window: pools of a few pages."""
    return ModelShape(name="tiny", layer_is_swa=layer_pattern(4, "sf"), window=window, num_heads=4, num_kv_heads=1,
                      head_dim=64)


def _w(conversations, turns, system, user, reply, concurrency, page_size, chunk):
    return ChatWorkload(conversations=conversations, turns=turns, system=system, user=user, reply=reply,
                        concurrency=concurrency, page_size=page_size, chunk=chunk, memory=1)


@pytest.mark.parametrize("window,w,size,size_swa", [
    # SWA pools a little over one or two turns' bound (full pools ample)
    (16, _w(3, 3, 16, 8, 60, 3, 16, 16), 1344, 176),
    (16, _w(3, 4, 16, 8, 20, 4, 4, 16), 1024, 112),
    (16, _w(2, 4, 64, 8, 60, 3, 16, 16), 2016, 192),
    (16, _w(3, 1, 100, 64, 20, 4, 4, 40), 1472, 88),
    (16, _w(5, 2, 16, 8, 60, 4, 8, 40), 1216, 112),
    # full pools a few pages over the longest turn (SWA pools ample)
    (16, _w(4, 4, 16, 8, 60, 2, 16, 16), 288, 9984),
    (16, _w(5, 3, 100, 30, 60, 4, 16, 16), 704, 9984),
    (32, _w(2, 4, 64, 30, 20, 3, 8, 40), 264, 9984),
    (16, _w(4, 3, 64, 8, 4, 4, 4, 40), 100, 9984),
], ids=["swa-p16", "swa-p4", "swa-2-running", "swa-chunk-p4", "swa-chunk-p8", "full-p16", "full-4-running",
        "full-w32", "full-stale-history"])
def test_tight_pools_admit_only_what_they_can_finish(window, w, size, size_swa):
    """Pools hand-sized a little over the longest turn: every admitted turn runs to its end. A running turn takes
    its whole context of full pages (the matched prefix is held already, and is locked before counting what the
    cache can evict) and pins its own window (window + margin + the page being written) and the window its cache
    lock keeps, beside one prefill chunk. Before, admission reserved 2 SWA pages a turn and a page per forward
    too few, and evicted the match it was about to acquire: these runs ran out of slots or acquired a stale match.
    A conversation whose cached history lost its window recomputes it, and caching its prompt locks the old pages
    beside its own: that room is made (with the match locked) before it starts."""
    from hwkv.bench.chat import _run_variant, _Sim

    sim = _Sim("hybrid", w, size, size_swa, window, "cpu")
    row = _run_variant(sim, 0)
    assert row.turns_done == w.conversations * w.turns


def test_cli_refuses_a_turn_that_never_fits_before_running(capsys, monkeypatch):
    """The issue's second command: the all-full pool of 80 MiB holds 1680 tokens, the last turn has 1952. Said
    at once, in one line naming both, exit code 2 (before: after running, "1 running turns need 32 more slots")."""
    from hwkv.cli import main

    order = _Order(monkeypatch)
    args = ["bench", "--workload", "chat", "--device", "cpu", "--conversations", "6", "--turns", "5",
            "--system-len", "512", "--user-len", "256", "--reply-len", "32", "--concurrency", "1",
            "--memory", "80MiB", "--page-size", "16", "--chunk", "256"]
    code = main(args)
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and order.events == []  # nothing ran
    assert len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err
    assert "(all-full)" in out.err and "1952 tokens" in out.err and "needs 1952 slots; the pool has 1680" in out.err


def test_a_turn_larger_than_the_hybrid_pools_is_refused_with_the_sizes():
    from hwkv.bench.chat import _Sim

    w = ChatWorkload(conversations=2, turns=2, system=64, user=32, reply=16, concurrency=1, page_size=16, chunk=32,
                     memory=1)
    assert w.context == 160
    # SWA: its own window, round_up(16 + 2 x 16, 16) = 48, and its lock's, round_up(16, 16) + 16 = 32
    with pytest.raises(OutOfSlotsError, match=r"\(hybrid\): a turn of 160 tokens .* needs 160 full-pool slots and "
                                              r"80 SWA slots beside a prefill chunk of 32; the pools have 144 full / "
                                              r"512 SWA"):
        _Sim("hybrid", w, 144, 512, 16, "cpu")
    with pytest.raises(OutOfSlotsError, match=r"needs 160 full-pool slots and 80 SWA slots beside a prefill chunk "
                                              r"of 32; the pools have 512 full / 96 SWA"):
        _Sim("hybrid", w, 512, 96, 16, "cpu")
    _Sim("hybrid", w, 160, 112, 16, "cpu")  # exactly enough
