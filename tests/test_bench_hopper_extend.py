"""benchmarks/bench_hopper_extend.py off a GPU: its sweep checks every config first and times them in interleaved
rounds (median), a config that fails is reported rather than fatal, and the warm-up shares between them build every
(case, config) launch exactly once. Stand-ins for the GPU cases and timers; the kernels themselves run on the H200."""
import dataclasses

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_hopper_extend")


class FakeCase:
    """A stand-in case whose Gluon launcher under a config records (its shape, the config) in `built` when run."""

    built = []

    def __init__(self, *shape):
        self.shape = shape

    def gluon_fn(self, cfg=None):
        return lambda: FakeCase.built.append((self.shape, cfg))

    def tflops(self, us):
        return 1000.0 / us if isinstance(us, float) else None


def test_the_sweep_checks_first_then_times_in_interleaved_rounds(bench, monkeypatch):
    cfg = bench.extend_hopper.HopperConfig
    a, b, broken = cfg(64, 6), cfg(32, 8), cfg(16, 2)
    monkeypatch.setattr(bench, "SWEEP", {64: [a, b, broken]})
    order = []

    def check(c, f):
        f()
        if FakeCase.built[-1][1] == broken:
            raise RuntimeError("out of resources")
        return 0.004

    def timed(f):
        f()
        which = FakeCase.built[-1][1]
        order.append(which)
        return {a: [30.0, 10.0, 20.0], b: [5.0, 7.0, 6.0]}[which][order.count(which) - 1]

    monkeypatch.setattr(bench, "check", check)
    monkeypatch.setattr(bench, "timed", timed)
    FakeCase.built = []
    res = bench.sweep_case(FakeCase(1, 8192, 0, None), 64, rounds=3)
    assert order == [a, b] * 3, "config after config, round after round"
    assert [r["config"] for r in res] == [b._asdict(), a._asdict(), broken._asdict()], "fastest first, failures last"
    assert res[0]["us"] == 6.0 and res[0]["runs"] == [5.0, 7.0, 6.0], "the median of the rounds"
    assert res[1]["us"] == 20.0 and res[1]["runs"] == [30.0, 10.0, 20.0]
    assert "out of resources" in res[2]["error"] and "us" not in res[2]
    assert res[0]["max_abs_err_vs_portable"] == 0.004 and res[0]["tflops"] == 1000.0 / 6.0


def test_the_warm_shares_build_every_launch_once(bench, monkeypatch):
    cfgs = [bench.extend_hopper.HopperConfig(n, 4) for n in (16, 32, 64)]
    monkeypatch.setattr(bench, "SWEEP", {64: cfgs})
    monkeypatch.setattr(bench, "Case", FakeCase)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    FakeCase.built = []
    for share in range(3):
        bench.warm_share(64, share, 3)
    want = [(tuple(case) + (64,), cfg) for case in bench.CASES for cfg in [None] + cfgs]
    assert sorted(map(repr, FakeCase.built)) == sorted(map(repr, want))
    FakeCase.built = []
    bench.warm_share(64, 0, 1, only=["window"])
    assert {shape[3] for shape, _ in FakeCase.built} == {128}, "--only window builds the window case alone"


def test_config_specs_name_tile_configs_and_refuse_what_is_not_one(bench):
    """--config [BASE:]field=value,...: the sweep's configs from the command line, over the dispatch's tiles."""
    eh = bench.extend_hopper
    assert bench.parse_config("causal", 64) == eh.CONFIGS[64]
    assert bench.parse_config("window", 64) == eh.WINDOW_CONFIGS[64]
    assert bench.parse_config("stages=4, q_regs=0", 64) == eh.CONFIGS[64]._replace(stages=4, q_regs=False)
    assert bench.parse_config(" Window : stages=6, q_regs=1 ", 128) == \
        eh.WINDOW_CONFIGS[128]._replace(stages=6, q_regs=True)
    assert bench.parse_config("defaults:block_n=128,stages=4,pingpong=TRUE", 64) == \
        eh.HopperConfig(128, 4, pingpong=True)
    for spec, why in [("", "empty spec"), ("tiles:stages=4", "base 'tiles'"), ("causal:stages", "not field=value"),
                      ("causal:depth=2", "no field 'depth'"), ("causal:stages=four", "not an integer"),
                      ("causal:q_regs=yes", "not 1, 0, true or false"), ("defaults:block_n=64", "needs stages"),
                      ("causal:stages=4,stages=6", "stages given twice"), ("causal:stages=0", "not an integer >= 1"),
                      ("causal:consumers=5", "takes 2, 3 or 4 consumer")]:
        with pytest.raises(ValueError, match=why):
            bench.parse_config(spec, 64)
    with pytest.raises(ValueError, match="no causal tiles for head dim 96"):
        bench.parse_config("causal", 96)


def test_config_specs_replace_the_sweep_and_reach_the_build_shares(bench, monkeypatch):
    """The command line's configs are what the sweep times and what the warm-up processes build (their argv)."""
    import subprocess
    import sys
    started = []

    class Child:
        returncode = 0

        def __init__(self, argv):
            started.append(argv)

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Child)
    bench.warm(type("Args", (), dict(d=[64], only=None, config=None, cap=0.0))(), 1)
    assert "--config" not in started.pop(), "no --config: the children build SWEEP's own"
    args = type("Args", (), dict(d=[64], only=None, config=["causal:stages=4", "window"], cap=50.0))()
    bench.warm(args, 2)
    assert len(started) == 2
    for i, argv in enumerate(started):
        assert argv[argv.index("--warm-share") + 1] == str(i)
        assert argv[argv.index("--cap") + 1] == "50.0", "the children build the capped kernels the timing runs"
        assert [argv[j + 1] for j, x in enumerate(argv) if x == "--config"] == ["causal:stages=4", "window"]
    monkeypatch.setattr(bench, "SWEEP", dict(bench.SWEEP))
    monkeypatch.setattr(sys, "argv", ["bench_hopper_extend.py", "--config", "causal:q_regs=2"])
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2, "a bad spec is a usage error (argparse), before anything else"
    monkeypatch.setattr(sys, "argv", ["bench_hopper_extend.py", "--d", "64", "128", "--config", "causal:stages=4",
                                      "--config", "window"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main()
    eh = bench.extend_hopper
    for d in (64, 128):
        assert bench.SWEEP[d] == [eh.CONFIGS[d]._replace(stages=4), eh.WINDOW_CONFIGS[d]], "the sweep is the specs'"
    for extra in (["--once", "0"], ["--no-cases"]):   # combinations that would sweep nothing are refused
        monkeypatch.setattr(sys, "argv", ["bench_hopper_extend.py", "--config", "causal", *extra])
        with pytest.raises(SystemExit) as e:
            bench.main()
        assert e.value.code == 2


def test_config_specs_imply_the_sweep(bench, monkeypatch):
    """--config alone runs the sweep: its build processes start (stopped there by a stand-in)."""
    import sys
    calls = []

    def warm(args, procs):
        calls.append((args.sweep, procs))
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench, "SWEEP", dict(bench.SWEEP))
    monkeypatch.setattr(bench, "warm", warm)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["bench_hopper_extend.py", "--config", "causal", "--warm", "2"])
    with pytest.raises(RuntimeError, match="stop here"):
        bench.main()
    assert calls == [(True, 2)]


@pytest.mark.parametrize("cap", ["-1", "nan", "inf", "x"])
def test_a_cap_that_is_not_a_finite_value_at_least_zero_is_a_usage_error(bench, monkeypatch, capsys, cap):
    import sys
    monkeypatch.setattr(sys, "argv", ["bench_hopper_extend.py", "--cap", cap])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    assert "--cap" in capsys.readouterr().err


@pytest.mark.parametrize("cap", [0.0, 50.0])
def test_a_capped_table_times_the_portable_kernel_under_both_tanh_forms(bench, monkeypatch, cap):
    """With --cap every case also times the portable kernel under the tanh its config does not take (the A/B behind
    ExtendConfig.fast_tanh), and the table gets that column; without a cap neither."""
    calls = []

    class Case(FakeCase):
        pairs = 1

        def __init__(self, bs, new, prefix, window, d):
            super().__init__(bs, new, prefix, window, d)

        def gluon_fn(self, cfg=None):
            return "n/a (stand-in)"

        def portable_config(self):   # a config taking the hardware's tanh
            return dataclasses.replace(bench.default_config(64), fast_tanh=True)

        def portable(self, fast_tanh=None):
            calls.append(fast_tanh)

        def sdpa_fn(self, backend):
            return "n/a (soft-cap)"

    monkeypatch.setattr(bench, "CAP", cap)
    monkeypatch.setattr(bench, "Case", Case)
    monkeypatch.setattr(bench, "timed", lambda fn: (fn(), 2.0)[1] if callable(fn) else fn)
    rows = bench.bench(64, only=["window"])
    assert calls == ([None, False] if cap else [None])   # the case's config takes the hardware's: the other is exact
    header = bench.table(rows).splitlines()[0]
    tanh = "exact"
    assert (f"| portable, {tanh} tanh |" in header) == bool(cap)
    assert all(("portable_other_tanh_us" in r) == bool(cap) for r in rows)
