"""Review 36 (bench area): `hwkv bench`'s command line and its percentiles. Each test is a minimal failing
reproduction of one defect; it states the correct behaviour and passes once the defect is fixed."""
from __future__ import annotations

import json

import pytest

from hwkv import cli
from hwkv.bench.spread import Spread, percentile

# a custom shape whose KV pools are tiny (1 KV head of dim 8) but whose query heads are 10**12: every tensor of
# the query heads' size (a forward's q, the synthetic model's query table) is hundreds of TiB, which no host has
_HUGE_Q_HEADS = ["--layers", "2", "--window", "8", "--heads", str(10**12), "--kv-heads", "1", "--head-dim", "8",
                 "--threads", "1"]
_WORKLOADS = {
    "decode": ["--batch-sizes", "1", "--steps", "1", "--warmup", "0", "--prompt-len", "16", "--no-graph"],
    "chat": ["--workload", "chat", "--conversations", "2", "--turns", "1", "--system-len", "16", "--user-len", "8",
             "--reply-len", "2", "--concurrency", "2", "--memory", "100MiB", "--chunk", "32"],
}


@pytest.mark.parametrize("workload", sorted(_WORKLOADS))
def test_bench_with_more_query_heads_than_memory_is_a_clean_exit_2(workload, capsys):
    """A --heads whose query tensors cannot be allocated ends in a RuntimeError traceback (exit 1, the
    reference-mismatch code): the memory checks price only the KV pools, never q / the synthetic query tables."""
    try:
        code = cli.main(["bench", *_WORKLOADS[workload], "--json", *_HUGE_Q_HEADS])
    except RuntimeError as e:  # the defect: torch's allocator error escapes main() as a traceback
        pytest.fail(f"hwkv bench --workload {workload} ended in a traceback: {type(e).__name__}: {str(e)[:120]}")
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("hwkv bench: error:") and len(err.strip().splitlines()) == 1


def test_serve_json_is_valid_json_for_an_infinite_rate(capsys):
    """`--serve-rate inf` is taken and `--json` then prints `"rate": Infinity`, which is not JSON (RFC 8259; jq
    and strict parsers refuse it): either refuse a non-finite rate (exit 2) or write a JSON value for it."""
    pytest.importorskip("transformers", reason="the serve workload runs a transformers model")
    code = cli.main(["bench", "--workload", "serve", "--serve-requests", "2", "--serve-rate", "inf", "--serve-new",
                     "2", "--serve-prompt-len", "16", "--threads", "1", "--no-baseline", "--json"])
    out = capsys.readouterr().out
    if code == 2:  # refused as a bad value: fine
        return
    assert code == 0

    def strict(name: str) -> None:
        raise AssertionError(f"--json printed the non-JSON constant {name}")

    json.loads(out, parse_constant=strict)


def test_percentile_of_equal_values_is_that_value():
    """`percentile` computes s[j] * (1 - f) + s[j + 1] * f, not the module doc's s[j] + f (s[j+1] - s[j]): for equal
    values it lands above them, so p10 exceeds both the median and the largest value (p10 <= p50 <= p90 breaks)."""
    assert percentile([0.1, 0.1, 0.1], 0.5) == 0.1
    assert percentile([0.1, 0.1, 0.1], 0.1) == 0.1  # 0.10000000000000002: above every value
    s = Spread.of([1e-4, 1e-4, 1e-4])
    assert s.p10_ms <= s.median_ms <= s.p90_ms, s
    xs = [0.1, 0.1, 0.1]
    for q in (0.1, 0.3, 0.7, 0.9, 0.99):
        assert min(xs) <= percentile(xs, q) <= max(xs), q


def test_a_serve_result_at_an_infinite_rate_is_json():
    """The library still takes rate=inf (every arrival at once, as 0); its result's dict is JSON all the same."""
    from hwkv.bench.serve import ServeResult, ServeWorkload
    d = ServeResult("m", "cpu", ServeWorkload(rate=float("inf"))).to_dict()
    assert json.loads(json.dumps(d, allow_nan=False))["workload"]["rate"] == 0.0
