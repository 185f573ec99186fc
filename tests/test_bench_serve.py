"""`hwkv bench --workload serve`: the seeded trace, the workload's checks, and a tiny run of both methods."""
import json
from collections import Counter

import pytest

pytest.importorskip("transformers", reason="the serve workload runs a transformers model")

from hwkv.bench.serve import ServeWorkload, make_trace  # noqa: E402
from hwkv.cli import main  # noqa: E402
from hwkv.errors import ConfigError  # noqa: E402


def test_the_trace_is_seeded_and_keeps_its_shape():
    w = ServeWorkload(requests=200, rate=10.0, prompt_len=40, spread=0.5, shared=0.25, system_len=12, seed=3)
    a, b = make_trace(w, 500), make_trace(w, 500)
    assert a == b and make_trace(ServeWorkload(requests=200, seed=4), 500) != make_trace(ServeWorkload(requests=200), 500)
    assert all(20 <= len(r.prompt) <= 40 and all(0 < t < 500 for t in r.prompt) for r in a)
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and 10 < times[-1] < 40  # 200 arrivals at 10/s: about 20 s
    (_, shared), = Counter(tuple(r.prompt[:12]) for r in a).most_common(1)  # the system prompt's head
    assert 25 < shared < 80  # about a quarter of 200
    assert all(r.arrival_s == 0 for r in make_trace(ServeWorkload(rate=0), 50))


@pytest.mark.parametrize("bad", [dict(requests=0), dict(rate=-1.0), dict(shared=1.5), dict(system_len=64),
                                 dict(spread=2.0), dict(new_tokens=0)])
def test_a_bad_workload_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="serve workload"):
        ServeWorkload(**bad)


def test_a_tiny_trace_through_both_methods(capsys):
    """Every request gets all its tokens from both; with one request at a time and every prompt behind the
    system prompt, each request after the first takes it from the prefix cache."""
    args = ["bench", "--workload", "serve", "--serve-requests", "4", "--serve-rate", "0", "--serve-prompt-len", "24",
            "--serve-new", "6", "--serve-shared", "1", "--serve-system-len", "16", "--serve-running", "1",
            "--page-size", "4", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "hwkv-bench-serve/1"
    hwkv, hf = data["rows"]
    assert hwkv["method"] == "hwkv" and hwkv["output_tokens"] == 24 and hwkv["error"] is None
    assert hwkv["reused_tokens"] == 3 * 16 and hwkv["ttft_p50_ms"] > 0 and hwkv["tpot_p99_ms"] >= hwkv["tpot_p50_ms"]
    assert hf["error"] is not None or hf["output_tokens"] == 24
    assert main(args[:-1] + ["--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "| hwkv |" in out and "of " in out and "continuous batching" not in out


def test_serve_refuses_plot(capsys):
    assert main(["bench", "--workload", "serve", "--plot", "x.png"]) == 2
    assert "--plot: the decode workload's; --workload serve does not read it" in capsys.readouterr().err
