"""benchmarks/bench_cuda_kernels.py off a GPU: it imports and parses its options, places pages as --layout says
(seeded), computes its metrics and renders its tables, refuses to run without a GPU in one line, and its decode
setup (pages at random places) gives the kernel's answer under the interpreter."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cuda_kernels.py"


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_cuda_kernels")


def test_options_keep_their_defaults_and_take_the_layout(bench):
    a = bench.parse_args([])
    assert (a.layout, a.page_size, a.seed, a.only, a.out, a.sweep, a.no_check) == (
        "random", 16, 0, "all", "bench_cuda_kernels.json", False, False)
    a = bench.parse_args(["--layout", "contiguous", "--page-size", "1", "--seed", "7", "--only", "decode",
                          "--sweep", "--no-check", "--out", "x.json", "--sweep-head-dims"])
    assert (a.layout, a.page_size, a.seed, a.only, a.out, a.sweep, a.no_check, a.sweep_head_dims) == (
        "contiguous", 1, 7, "decode", "x.json", True, True, True)
    for bad in (["--layout", "striped"], ["--page-size", "0"], ["--only", "store"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def _pages(slots, page):
    """Each request's page ids, checking that every page is whole-aligned and filled in order."""
    r, n = slots.shape
    full = n // page * page
    p = slots[:, :full].view(r, -1, page)
    assert torch.equal(p - p[:, :, :1], torch.arange(page).expand_as(p)), "a page's slots are consecutive"
    assert (p[:, :, 0] % page == 0).all(), "pages start at multiples of the page size"
    return p[:, :, 0] // page


@pytest.mark.parametrize("page", [1, 16])
def test_random_layout_deals_a_seeded_permutation_of_the_pool_pages(bench, page):
    requests, tokens = 6, 64
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    slots = bench.place_pages(requests, tokens, page, "random", gen(3), torch.device("cpu"))
    assert slots.shape == (requests, tokens) and slots.dtype == torch.int64
    pages = _pages(slots, page)
    n_pages = bench.pool_slots(requests, tokens, page) // page
    assert sorted(pages.reshape(-1).tolist()) == list(range(1, n_pages)), "every page but page 0, once"
    steps = pages[:, 1:] - pages[:, :-1]
    assert (steps != 1).float().mean() > 0.5, "a request's pages are not one run"
    assert torch.equal(slots, bench.place_pages(requests, tokens, page, "random", gen(3), torch.device("cpu")))
    assert not torch.equal(slots, bench.place_pages(requests, tokens, page, "random", gen(4), torch.device("cpu")))


def test_contiguous_layout_gives_each_request_one_run(bench):
    requests, tokens, page = 5, 40, 16       # 40 tokens: the last page is partly used
    slots = bench.place_pages(requests, tokens, page, "contiguous", torch.Generator().manual_seed(0),
                              torch.device("cpu"))
    assert torch.equal(slots - slots[:, :1], torch.arange(tokens).expand_as(slots))
    assert (slots[:, 0] % page == 0).all() and slots.min() >= page
    assert slots.max() < bench.pool_slots(requests, tokens, page)
    starts = sorted(slots[:, 0].tolist())
    assert all(b - a >= 3 * page for a, b in zip(starts, starts[1:])), "runs do not overlap"
    with pytest.raises(ValueError, match="layout"):
        bench.place_pages(requests, tokens, page, "striped", torch.Generator(), torch.device("cpu"))


def test_metrics_and_tables(bench):
    assert bench.H200_BF16_TFLOPS == 989.4
    assert bench.tflops(2e12, 1e6) == pytest.approx(2.0)
    assert bench.frac_peak(989.4) == pytest.approx(1.0) and bench.frac_peak(None) is None
    assert bench.time_ratio(10.0, 12.5) == pytest.approx(0.8)
    assert bench.time_ratio(10.0, "n/a (RuntimeError)") is None and bench.tflops(1e12, "n/a") is None
    dec = dict(batch=16, context=4096, window=None, scatter=False, layout="random", page=16, keys=4096, splits=5,
               merge="in place", us=10.0, us_fused_merge=10.0, us_merge_kernel=12.0, frac_copy_bw=0.9,
               tflops=27.5, frac_peak=0.028, sdpa_us=12.0, sdpa_cudnn_us=12.5, vs_cudnn=0.8,
               sdpa_flash_us="n/a (RuntimeError)", vs_flash=None)
    one = dict(dec, splits=1, merge="none", us_fused_merge=None, us_merge_kernel=None)
    text = bench.table(4e12, [dict(tokens=1, us_36_layers=5.0, pct_copy_bw=50.0, best_us=4.0)], [dec, one])
    assert "random pages of 16" in text and "| 0.80x |" in text and "n/a (RuntimeError)" in text
    assert "| 10.0 / 12.0 |" in text
    ext = dict(batch=1, new=8192, prefix=0, window=None, layout="random", page=16, us=100.0, tflops=400.0,
               frac_peak=400 / 989.4, frac_copy_bw=0.1, sdpa_flash_us=120.0, sdpa_flash_tflops=333.0,
               sdpa_cudnn_us=90.0, sdpa_cudnn_tflops=444.0, vs_cudnn=100 / 90, vs_flash=100 / 120)
    text = bench.extend_table([ext])
    assert "| 1.11x | 0.83x |" in text and "| 0.404 |" in text


def test_decode_setup_with_random_pages_matches_dense_attention(bench, monkeypatch):
    """The setup's index lists (random pages, rotated sets) and its check run on the CPU under the interpreter."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the benchmark itself runs these checks")
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "L2_BYTES", 2 * 2 * 48 * bench.KVH * 2 * bench.D * 2)   # two rotated KV sets
    s = bench.DecodeSetup(2, 48, dense=True, seed=1)
    assert s.reps == 2 and len(s.indices) == 2 and s.dense[0][0].shape == (2, bench.KVH, 48, bench.D)
    assert torch.unique(torch.cat(s.indices)).numel() == 2 * 2 * 48, "the rotated sets are disjoint"
    errs = bench.check_decode_large(cases=((2, 48, None), (2, 48, 16)))
    assert all(e < 1e-2 for e in errs.values()), errs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_and_help_lists_the_layout():
    r = subprocess.run([sys.executable, str(SCRIPT), "--layout", "random", "--no-check"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "needs a CUDA GPU" in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "--layout" in r.stdout and "contiguous" in r.stdout


def test_merge_checks_compare_both_merges_on_the_benchmark_shape(bench, monkeypatch):
    """check_decode_merges on the benchmark's layer shape, made to split by a larger stand-in SM count."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the benchmark itself runs these checks")
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "L2_BYTES", 1)
    monkeypatch.setattr(bench.decode_mod, "num_sms", lambda device: 64)
    s = bench.DecodeSetup(1, 64, dense=False)
    assert s.plan().splits == 4 and s.plan().fused
    errs = bench.check_decode_merges(cases=((1, 64),), repeats=2)
    assert list(errs) == ["decode 1x64 merge in place vs kernel",
                          "decode 1x64 merge in place repeated (max abs change, must be 0)"]
    assert errs["decode 1x64 merge in place vs kernel"] < 1e-2
    assert errs["decode 1x64 merge in place repeated (max abs change, must be 0)"] == 0


def test_decode_config_specs_parse_or_are_refused_before_any_device_time(bench):
    """--decode-config field=value,... over DecodeConfig's fields: typed by each field's default, a byte bound may
    be 0; anything else is a usage error naming the spec, as is the option where the decode section does not run."""
    assert bench.parse_decode_config("heads_per_program=4, block_n=64") == dict(heads_per_program=4, block_n=64)
    assert bench.parse_decode_config("pdl=0,fused_merge_bytes=0") == dict(pdl=False, fused_merge_bytes=0)
    for spec, why in [("", "empty spec"), (" , ", "no field=value"), ("block_n", "not field=value"),
                      ("depth=2", "no field 'depth'"), ("block_n=sixty", "not an integer"),
                      ("pdl=yes", "not 1, 0, true or false"), ("block_n=64,block_n=32", "block_n given twice"),
                      ("num_stages=0", "not an integer >= 1"), ("fused_merge_bytes=-1", "not an integer >= 0")]:
        with pytest.raises(ValueError, match=why):
            bench.parse_decode_config(spec)
    a = bench.parse_args(["--only", "decode", "--decode-config", "block_n=64", "--decode-config", "num_stages=4",
                          "--rounds", "5"])
    assert a.decode_changes == [("block_n=64", {"block_n": 64}), ("num_stages=4", {"num_stages": 4})]
    assert a.rounds == 5 and bench.parse_args([]).decode_changes == []
    for bad in (["--decode-config", "depth=2"], ["--only", "extend", "--decode-config", "block_n=64"],
                ["--decode-config", "block_n=64", "--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_decode_cells_replace_the_recorded_cases(bench):
    """--decode-cells BxC[xW],...: the decode cases timed instead of the recorded ones; a bad item is a usage error."""
    assert bench.parse_args([]).decode_cases == bench.DECODE_CASES
    a = bench.parse_args(["--only", "decode", "--decode-cells", "8x4096, 32X4096,1x32768x128"])
    assert a.decode_cases == [(8, 4096, None, False), (32, 4096, None, False), (1, 32768, 128, False)]
    for bad, why in [("8x", "'8x' is not"), ("8x4096,", "'' is not"), ("0x4096", "'0x4096'"), ("4x4x4x4", "4x4x4x4"),
                     ("ax4", "'ax4'")]:
        with pytest.raises(ValueError, match=why):
            bench.parse_decode_cells(bad)
    for bad in (["--decode-cells", "8x"], ["--only", "extend", "--decode-cells", "8x4096"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_profile_decode_takes_one_cell(bench):
    """--profile-decode BxC[xW]: the one cell the profiler target runs; a bad or second cell is a usage error."""
    assert bench.parse_args([]).profile_cell is None
    assert bench.parse_args(["--profile-decode", "24x4096"]).profile_cell == (24, 4096, None, False)
    assert bench.parse_args(["--profile-decode", "1x32768x128"]).profile_cell == (1, 32768, 128, False)
    for bad in (["--profile-decode", "24x"], ["--profile-decode", "1x4096,2x4096"], ["--profile-decode", ""]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_decode_variants_are_timed_in_interleaved_rounds_beside_the_dispatched_config(bench):
    """time_variants: each round times the dispatched config, then every variant; medians and the ratio to the
    dispatched config's; a variant that fails is a result row and the others still run."""
    base = bench.DecodeConfig()
    times = {repr(base): [10.0, 12.0, 11.0], repr(bench.dataclasses.replace(base, block_n=64)): [9.0, 8.0, 8.5]}
    order = []

    class Setup:
        def config(self):
            return base

        def time(self, cfg):
            order.append(cfg.block_n)
            if cfg.num_stages == 7:
                raise RuntimeError("out of shared memory")
            return times[repr(cfg)].pop(0), 1

    res, dispatched = bench.time_variants(Setup(), [("block_n=64", {"block_n": 64}), ("st", {"num_stages": 7})], 3)
    assert dispatched == 11.0
    assert order == [128, 64, 128, 128, 64, 128, 64], "interleaved; the failed variant is not retried"
    ok = [r for r in res if "us" in r]
    assert len(ok) == 1 and ok[0]["spec"] == "block_n=64" and ok[0]["us"] == 8.5 and ok[0]["runs"] == [9.0, 8.0, 8.5]
    assert ok[0]["vs_dispatched"] == pytest.approx(8.5 / 11.0)
    assert [r["spec"] for r in res if "error" in r] == ["st"] and "shared memory" in res[0]["error"]


def test_a_variant_row_reads_as_text_whatever_failed(bench):
    row = dict(variants_dispatched_us=11.0)
    assert bench.variant_cell(dict(us=8.5, vs_dispatched=8.5 / 11.0), row) == "8.5 us against 11.0 (0.773x)"
    assert bench.variant_cell(dict(us=8.5, vs_dispatched=None), dict(variants_dispatched_us=None)) == \
        "8.5 us (the dispatched config failed)"
    assert bench.variant_cell(dict(spec="x", error="RuntimeError: boom"), row) == "RuntimeError: boom"
