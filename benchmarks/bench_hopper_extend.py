"""Prefill/extend on Hopper: the Gluon sm_90 kernel (hwkv_cuda.kernels.extend_hopper) against the portable
Triton kernel and torch SDPA (cuDNN and flash backends over dense K/V), each under a CUDA graph.

    python3 benchmarks/bench_hopper_extend.py [--json out.json] [--d 64 128] [--sweep] [--host] [--threshold] [--cap C]

Cases (issue 25): 1 x 8192 causal, 4 x 2048 new over a 2048 prefix, 8 x 1024 causal, 1 x 8192 with W=128;
H=64, KVH=8, D=64 (or 128), bf16, pages of 16 at random places. TFLOP/s counts visible (query, key) pairs only,
the same way for every kernel (4 * pairs * H * D flops). Each case first checks the Gluon output against the
portable kernel's (max abs error, reported). With HWKV_HOPPER_EXTEND=0 the Gluon column reads n/a.
--sweep also times the Gluon kernel under each of SWEEP's configs for the head dim (keys per tile, stages, consumer
registers, persistence, ping-pong, Q in registers, consumer warpgroups), each checked against the portable kernel
first, and reports them per case, fastest first; --rounds N times them in N interleaved rounds (median), and
--warm P first builds them in P processes at once (lent GPU time goes to timing, not to compiling). --config SPEC
(repeatable) sweeps the given configs instead of SWEEP's, with no code edit: SPEC is BASE | [BASE:]field=value,...
over the HopperConfig fields, BASE `causal` (the dispatch's causal tiles for the head dim, the default), `window` (its
window tiles) or `defaults` (HopperConfig's defaults; block_n and stages then required), e.g.
`--config causal --config causal:stages=4,q_regs=0 --config window:consumers=3,consumer_regs=152`. --host adds the
host time of one planned layer call per kernel;
--threshold both kernels at small prefills, causal and W=128, under a graph and eagerly (what the dispatch's
MIN_TOKENS and min_window_tokens rest on).
--once N runs only the Gluon kernel on case N (0-3, in the order above) three times, eagerly, for a profiler:

    ncu --clock-control none -k regex:hopper_extend --launch-skip 2 --launch-count 1 --set full --import-source yes \
        -o prof python3 benchmarks/bench_hopper_extend.py --once 2
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv   # stall reasons per instruction
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cuda_kernels import graph_us, parse_fields  # noqa: E402  (this folder: one timer and one spec parser)
from hwkv.errors import ConfigError  # noqa: E402
from hwkv_cuda.kernels import extend_hopper  # noqa: E402
from hwkv_cuda.kernels.extend import (default_config, extend_attention, extend_attention_planned,  # noqa: E402
                                      plan_extend)

H, KVH, PAGE = 64, 8, 16
DT = torch.bfloat16
DEV = torch.device("cuda")
CASES = [(1, 8192, 0, None), (4, 2048, 2048, None), (8, 1024, 0, None), (1, 8192, 0, 128)]   # bs, new, prefix, W
CAP = 0.0   # --cap: every hwkv kernel's logit soft-cap (SDPA has none: its columns read n/a)
# D=64 tiles and schedules that compile for sm_90 without spills (Triton 3.6): keys per tile, stages, consumer
# registers, persistent programs, ping-pong between the consumers, Q in registers
_C = extend_hopper.HopperConfig
# 32-key tiles: a window item (NC x BT tokens over W + NC x BT - 1 keys) wastes less of its last tile
SWEEP = {64: [_C(64, 6, 152, consumers=3), _C(64, 8, 152, consumers=3), _C(64, 6, 144, consumers=3),
             _C(64, 6, 152, q_regs=True, consumers=3), _C(64, 4, 152, q_regs=True, consumers=3), _C(128, 4, 208),
             _C(32, 8, 152, consumers=3), _C(32, 6, 152, consumers=3), _C(32, 8, 200),
             _C(32, 8, 152, q_regs=True, consumers=3), _C(32, 6, 152, q_regs=True, consumers=3),
             _C(32, 8, 104, consumers=4), _C(32, 6, 104, consumers=4), _C(32, 8, 104, q_regs=True, consumers=4)],
         128: [_C(64, 4, 208), _C(64, 3, 152, consumers=3), _C(64, 4, 152, consumers=3), _C(32, 6, 152, consumers=3),
               _C(32, 4, 152, consumers=3), _C(32, 6, 208), _C(32, 4, 152, q_regs=True, consumers=3)]}


class Case:
    """`bs` requests of `new` tokens over `prefix` cached ones; K/V in pages of 16 at random places."""

    def __init__(self, bs, new, prefix, window, d):
        seq = prefix + new
        self.bs, self.new, self.prefix, self.window, self.d = bs, new, prefix, window, d
        pages_per = -(-seq // PAGE)
        n_pages = bs * pages_per + 1
        self.k_buf = torch.randn(n_pages * PAGE, KVH, d, device=DEV).to(DT)
        self.v_buf = torch.randn(n_pages * PAGE, KVH, d, device=DEV).to(DT)
        order = (torch.randperm(n_pages - 1, device=DEV) + 1).view(bs, pages_per)
        self.slots = (order[:, :, None] * PAGE + torch.arange(PAGE, device=DEV)).reshape(bs, -1)[:, :seq]
        pos0 = max(0, prefix - window + 1) if window else 0      # a window layer's list starts at the window
        self.indices = self.slots[:, pos0:].reshape(-1).contiguous()
        i32, i64 = dict(dtype=torch.int32, device=DEV), dict(dtype=torch.int64, device=DEV)
        self.kv_indptr = torch.arange(bs + 1, **i32) * (seq - pos0)
        self.qo_indptr = torch.arange(bs + 1, **i32) * new
        self.kv_pos0 = torch.full((bs,), pos0, **i64)
        self.q_pos0 = torch.full((bs,), prefix, **i64)
        self.q = torch.randn(bs * new, H, d, device=DEV).to(DT)
        self.out = torch.empty_like(self.q)
        qp, kp = torch.arange(prefix, seq, device=DEV), torch.arange(seq, device=DEV)
        self.mask = kp[None, :] <= qp[:, None]
        if window:
            self.mask &= kp[None, :] > qp[:, None] - window
        self.pairs = bs * int(self.mask.sum())
        self.args = (self.q, self.k_buf, self.v_buf, self.kv_indptr, self.indices, self.kv_pos0, self.qo_indptr,
                     self.q_pos0, self.out)

    def tflops(self, us):
        return 4 * self.pairs * H * self.d / (us * 1e-6) / 1e12 if isinstance(us, float) else None

    def portable_config(self):
        """The portable kernel's config as the dispatch gives it for this case."""
        return default_config(self.d, False, self.window, DEV)

    def portable(self, fast_tanh=None):
        """The portable kernel under the dispatch's config; with a cap, its tanh the config's, the hardware's (True)
        or the exact form (False)."""
        cfg = self.portable_config()
        if fast_tanh is not None:
            cfg = dataclasses.replace(cfg, fast_tanh=fast_tanh)
        extend_attention(*self.args, self.new, self.d ** -0.5, self.window, CAP, config=cfg)


    def gluon_fn(self, config=None):
        """A launcher of the Gluon kernel (under `config`'s tiles where given), or the reason there is none."""
        if not extend_hopper.requested():
            return f"n/a ({extend_hopper.ENV_FLAG} not set)"
        why = extend_hopper.unsupported(self.q, self.k_buf, self.v_buf, self.out, self.new)
        if why:
            return f"n/a ({why})"
        plan = extend_hopper.plan_hopper_extend(self.q, self.k_buf, self.v_buf, self.out, self.new,
                                                window=self.window)   # the tiles the dispatch gives this layer
        if config is not None:
            plan = extend_hopper._plan(H // KVH, KVH, self.d, self.new, config, DEV)

        def run():
            assert extend_hopper.run_hopper_extend(plan, *self.args, self.d ** -0.5, self.window, CAP)
        return run

    def sdpa_fn(self, backend):
        if CAP:
            return "n/a (soft-cap)"
        q4 = self.q.view(self.bs, self.new, H, self.d).transpose(1, 2)
        k4 = self.k_buf[self.slots].transpose(1, 2).contiguous()     # dense [bs, KVH, seq, D]
        v4 = self.v_buf[self.slots].transpose(1, 2).contiguous()
        kw = dict(scale=self.d ** -0.5)
        if self.window:
            kw["attn_mask"] = self.mask
        elif self.prefix:
            from torch.nn.attention.bias import causal_lower_right
            kw["attn_mask"] = causal_lower_right(self.new, self.prefix + self.new)
        else:
            kw["is_causal"] = True
        last = None
        for gqa in (True, False):     # some backends refuse enable_gqa: K/V per q head instead
            k, v = (k4, v4) if gqa else (k4.repeat_interleave(H // KVH, 1), v4.repeat_interleave(H // KVH, 1))

            def f(k=k, v=v, gqa=gqa):
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa, **kw)
            try:
                f()
                return f
            except Exception as e:  # noqa: BLE001 - reported in the table
                last = f"n/a ({type(e).__name__})"
        return last


def timed(fn):
    if isinstance(fn, str):
        return fn
    try:
        return graph_us([fn], reps=20)
    except Exception as e:  # noqa: BLE001 - a failure is a result here: reported, the other columns still run
        return f"failed ({type(e).__name__}: {str(e)[:120]})"


def check(c, g):
    """Max abs difference of the Gluon launcher g's output from the portable kernel's."""
    c.out.fill_(float("nan"))
    c.portable()
    want = c.out.float().clone()
    c.out.fill_(float("nan"))
    g()
    torch.cuda.synchronize()
    return (c.out.float() - want).abs().max().item()


def cases(only=None):
    """CASES, or only the causal or the window ones (--only)."""
    return [x for x in CASES if only is None or ("window" if x[3] else "causal") in only]


def sweep_case(c, d, rounds):
    """SWEEP's configs on case c: each checked against the portable kernel, then timed in `rounds` interleaved rounds
    (config after config, so the machine's drift falls on all of them alike): median us and every round's."""
    fns, res = {}, []
    for cfg in SWEEP[d]:
        try:
            f = c.gluon_fn(cfg)
            fns[cfg] = (f, check(c, f))
        except Exception as e:  # noqa: BLE001 - a config that fails to build or run is a result
            res.append(dict(config=cfg._asdict(), error=f"{type(e).__name__}: {str(e)[:120]}"))
    runs = {cfg: [] for cfg in fns}
    for _ in range(rounds):
        for cfg, (f, _err) in fns.items():
            runs[cfg].append(timed(f))
    for cfg, (f, err) in fns.items():
        ok = [u for u in runs[cfg] if isinstance(u, float)]
        us = statistics.median(ok) if ok else runs[cfg][0]
        res.append(dict(config=cfg._asdict(), us=us, runs=runs[cfg], tflops=c.tflops(us), max_abs_err_vs_portable=err))
    return sorted(res, key=lambda r: r["us"] if isinstance(r.get("us"), float) else float("inf"))


def warm_share(d, share, shares, only=None):
    """Build this share of the sweep's (case, config) launches (and the dispatch's own tiles) by running each once:
    the compiled kernels land in Triton's cache on disk, where the timing process finds them."""
    k = 0
    for bs, new, prefix, window in cases(only):
        c = None
        for cfg in [None] + SWEEP[d]:
            if k % shares == share:
                c = c or Case(bs, new, prefix, window, d)
                try:
                    f = c.gluon_fn(cfg)
                    if not isinstance(f, str):
                        f()
                except Exception as e:  # noqa: BLE001 - the timing process reports it
                    print(f"warm: {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            k += 1
    torch.cuda.synchronize()


CONFIG_BASES = ("causal", "window", "defaults")


def parse_config(spec, d):
    """The tile config a --config SPEC names for head dim d: BASE | [BASE:]field=value,... (see the module doc);
    ValueError naming what is wrong, here rather than after device time is spent."""
    text = spec.strip()
    if not text:
        raise ValueError("--config '': an empty spec (give a base, field=value pairs or both)")
    if ":" in text:
        base, body = text.split(":", 1)
    else:
        base, body = (text, "") if text.lower() in CONFIG_BASES else ("causal", text)
    base = base.strip().lower()
    if base not in CONFIG_BASES:
        raise ValueError(f"--config {spec!r}: base {base!r} is not one of {', '.join(CONFIG_BASES)}")
    cfg_type = extend_hopper.HopperConfig
    # block_n and stages have no default: 0 stands in (any int), so they parse as the ints they are
    typed = parse_fields("--config", spec, body, {f: cfg_type._field_defaults.get(f, 0) for f in cfg_type._fields})
    if base == "defaults":
        missing = [k for k in ("block_n", "stages") if k not in typed]
        if missing:
            raise ValueError(f"--config {spec!r}: base defaults needs {' and '.join(missing)}")
        cfg = cfg_type(**typed)
    else:
        tiles = extend_hopper.WINDOW_CONFIGS if base == "window" else extend_hopper.CONFIGS
        if d not in tiles:
            raise ValueError(f"--config {spec!r}: no {base} tiles for head dim {d} (only {sorted(tiles)})")
        cfg = tiles[d]._replace(**typed)
    try:
        extend_hopper._consts(1, d, cfg, 1)   # the kernel's own checks
    except ConfigError as e:
        raise ValueError(f"--config {spec!r}: {e}") from None
    return cfg


def warm(args, procs):
    """Compile the sweep in `procs` child processes at once (the builds are CPU-bound, the lent GPU's host has cores to
    spare), before the timing starts."""
    base = [sys.executable, __file__, "--d", *map(str, args.d)] + (["--only", *args.only] if args.only else [])
    base += [x for spec in args.config or [] for x in ("--config", spec)] + ["--cap", repr(args.cap)]
    children = [subprocess.Popen(base + ["--warm-share", str(i), str(procs)]) for i in range(procs)]
    for i, ch in enumerate(children):
        if ch.wait():   # the timing still runs (and builds what this share did not): reported, not fatal
            print(f"warm: share {i} of {procs} exited with {ch.returncode}", flush=True)


def bench(d, sweep=False, only=None, rounds=1):
    rows = []
    for bs, new, prefix, window in cases(only):
        c = Case(bs, new, prefix, window, d)
        row = dict(case=f"{bs} x {new}" + (f" over {prefix}" if prefix else "") + (f" W={window}" if window else
                                                                                   " causal"),
                   bs=bs, new=new, prefix=prefix, window=window, d=d, pairs=c.pairs)
        g = c.gluon_fn()
        if not isinstance(g, str):   # correctness first: the Gluon output against the portable kernel's
            row["max_abs_err_vs_portable"] = check(c, g)
        if sweep and not isinstance(g, str):
            row["sweep"] = sweep_case(c, d, rounds)
        row["portable_fast_tanh"] = fast = c.portable_config().fast_tanh
        other = [("portable_other_tanh", lambda: c.portable(fast_tanh=not fast))] if CAP else []
        for name, fn in [("gluon", g), ("portable", c.portable), *other,   # with a cap: the tanh's A/B too
                         ("sdpa_cudnn", c.sdpa_fn(SDPBackend.CUDNN_ATTENTION)),
                         ("sdpa_flash", c.sdpa_fn(SDPBackend.FLASH_ATTENTION))]:
            us = timed(fn)
            row[f"{name}_us"], row[f"{name}_tflops"] = us, c.tflops(us)
        for other in ("portable", "sdpa_cudnn", "sdpa_flash"):   # > 1: the Gluon kernel is faster
            a, b = row["gluon_us"], row[f"{other}_us"]
            row[f"speedup_vs_{other}"] = b / a if isinstance(a, float) and isinstance(b, float) else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


THRESHOLD_CASES = [(1, t, 0) for t in (256, 512, 1024, 2048, 4096)] + [(4, t, 1024) for t in (64, 128, 256, 512)]
# ... and for window layers (W=128: the list is the window), where min_window_tokens(D) applies: from MIN_TOKENS up
THRESHOLD_WINDOW_CASES = [(1, t, 0) for t in (1024, 2048, 4096, 8192)] + [(4, t, 1024) for t in (256, 512, 1024)]
THRESHOLD_WINDOW = 128


@contextlib.contextmanager
def thresholds_lifted():
    """The dispatch's token thresholds lifted (small calls plan the Gluon kernel), the switch and them restored."""
    saved = extend_hopper.MIN_TOKENS, extend_hopper.MIN_WINDOW_TOKENS
    extend_hopper.MIN_TOKENS = extend_hopper.MIN_WINDOW_TOKENS = 0
    try:
        yield
    finally:
        os.environ.pop(extend_hopper.ENV_FLAG, None)
        extend_hopper.MIN_TOKENS, extend_hopper.MIN_WINDOW_TOKENS = saved


def planned_calls(c):
    """(kernel, one planned layer call of case c through it, as the backend makes them: plan once, then
    `extend_attention_planned`) for the Gluon and the portable kernel; a string where the plan lacks the kernel.
    Inside `thresholds_lifted`."""
    for name, flag in (("gluon", "1"), ("portable", "0")):
        os.environ[extend_hopper.ENV_FLAG] = flag
        plan = plan_extend(*c.args, c.new, window=c.window)
        if (plan.hopper is not None) != (name == "gluon"):
            yield name, f"n/a (the plan {'lacks' if name == 'gluon' else 'has'} the Gluon kernel)"
            continue
        yield name, lambda plan=plan: extend_attention_planned(plan, *c.args, c.new, c.d ** -0.5, c.window)


def threshold(d, calls=50):
    """Where the Gluon kernel starts to pay at small prefills: for each case (bs, new tokens each, prefix; causal, then
    window layers at W=THRESHOLD_WINDOW), its time and the portable kernel's under a CUDA graph (device) and eager
    (`calls` planned layer calls queued back to back, one sync: max of host and device per call), the dispatch's
    token thresholds lifted."""
    rows = []
    cases = [(*x, None) for x in THRESHOLD_CASES] + [(*x, THRESHOLD_WINDOW) for x in THRESHOLD_WINDOW_CASES]
    with thresholds_lifted():
        for bs, new, prefix, window in cases:
            c = Case(bs, new, prefix, window, d)
            row = dict(d=d, bs=bs, new=new, prefix=prefix, window=window, tokens=bs * new)
            for name, call in planned_calls(c):
                if isinstance(call, str):
                    row[name] = call
                    continue
                row[f"{name}_graph_us"] = timed(call)
                eager = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        call()
                    torch.cuda.synchronize()
                    eager.append((time.perf_counter() - t0) / calls * 1e6)
                row[f"{name}_eager_us"] = sorted(eager)[2]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def host_us(calls=300):
    """Host time of one planned layer call through each kernel, at a small prefill (2 x 64 tokens over a 512-token
    prefix) whose device time stays under the host's, the dispatch's token threshold lifted: median of per-call wall
    times, the launches queued without a sync."""
    c = Case(2, 64, 512, None, 64)
    res = {}
    with thresholds_lifted():
        for name, call in planned_calls(c):
            if isinstance(call, str):
                res[name] = call
                continue
            times = []
            for i in range(calls):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
                if i % 50 == 49:
                    torch.cuda.synchronize()
            times.sort()
            res[name] = times[len(times) // 2] * 1e6
    return res


def fmt(us, tf):
    return f"{us:.1f} ({tf:.0f})" if isinstance(us, float) else str(us)


def table(rows):
    other = "portable_other_tanh_us" in rows[0]   # --cap: the portable kernel with the other tanh too
    tanh = "exact" if rows[0].get("portable_fast_tanh") else "hardware"
    lines = [f"| case (H={H} KVH={KVH} D={rows[0]['d']} bf16, page {PAGE} random) | gluon us (TFLOP/s) | portable "
             + (f"| portable, {tanh} tanh " if other else "") +
             "| SDPA cuDNN | SDPA flash | gluon speedup vs portable / cuDNN / flash | max err vs portable |",
             "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if other else "")]
    for r in rows:
        sp = " / ".join(f"{r[f'speedup_vs_{o}']:.2f}x" if r[f"speedup_vs_{o}"] else "-"
                        for o in ("portable", "sdpa_cudnn", "sdpa_flash"))
        err = r.get("max_abs_err_vs_portable")
        cells = [fmt(r[f"{k}_us"], r[f"{k}_tflops"]) for k in ("gluon", "portable") + ("portable_other_tanh",) * other
                 + ("sdpa_cudnn", "sdpa_flash")]
        lines.append(f"| {r['case']} | {' | '.join(cells)} | {sp} | {'-' if err is None else format(err, '.3g')} |")
    return "\n".join(lines)


def once(d, index, calls=3):
    """The Gluon kernel of CASES[index], `calls` times back to back (no graph): one launch for a profiler to take."""
    c = Case(*CASES[index], d)
    g = c.gluon_fn()
    if isinstance(g, str):
        sys.exit(f"case {index}: the Gluon kernel does not run: {g}")
    for _ in range(calls):
        g()
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--d", type=int, nargs="+", default=[64], help="head dims (64 and/or 128)")
    ap.add_argument("--sweep", action="store_true", help="also time the Gluon kernel under each SWEEP config")
    ap.add_argument("--host", action="store_true", help="also the host time of one planned layer call per kernel")
    ap.add_argument("--threshold", action="store_true",
                    help="also both kernels at small prefills (graph and eager), for the dispatch's token threshold")
    ap.add_argument("--no-cases", action="store_true", help="skip the issue's four cases")
    ap.add_argument("--only", nargs="+", choices=["causal", "window"], help="only the causal or the window cases")
    ap.add_argument("--once", type=int, choices=range(len(CASES)),
                    help="only run the Gluon kernel on this case three times, eagerly (for ncu)")
    ap.add_argument("--rounds", type=int, default=1, help="--sweep: interleaved rounds per config (median reported)")
    ap.add_argument("--warm", type=int, default=0, metavar="PROCS",
                    help="--sweep: first build every config's kernels in PROCS processes at once")
    ap.add_argument("--config", action="append", metavar="SPEC",
                    help="sweep this tile config instead of SWEEP's (repeatable; implies --sweep): BASE | "
                         "[BASE:]field=value,... with BASE causal (default), window or defaults (which needs "
                         "block_n and stages)")
    ap.add_argument("--cap", type=float, default=0.0,
                    help="soft-cap the logits of hwkv's kernels at this value (0: none; SDPA has none, its columns read "
                         "n/a)")
    ap.add_argument("--warm-share", type=int, nargs=2, metavar=("I", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not (a.cap >= 0 and math.isfinite(a.cap)):
        ap.error(f"--cap {a.cap}: a soft-cap is a finite value >= 0 (0: none)")
    global CAP
    CAP = a.cap
    if a.config and (a.once is not None or a.no_cases):
        ap.error("--config sweeps the issue's cases: not with --once (which profiles the dispatch's tiles) or "
                 "--no-cases")
    if a.config:
        try:
            for d in a.d:
                SWEEP[d] = [parse_config(spec, d) for spec in a.config]
        except ValueError as e:
            ap.error(str(e))
        a.sweep = True
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if a.once is not None:
        for d in a.d:
            once(d, a.once)
        return
    if a.warm_share:
        for d in a.d:
            warm_share(d, *a.warm_share, a.only)
        return
    if a.sweep and a.warm > 0:
        warm(a, a.warm)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cap=CAP,
                  triton=__import__("triton").__version__, gluon_error=extend_hopper.GLUON_ERROR, rows=[])
    for d in a.d:
        if a.threshold:
            result.setdefault("threshold", []).extend(threshold(d))
        if a.no_cases:
            continue
        rows = bench(d, a.sweep, a.only, a.rounds)
        result["rows"] += rows
        print(table(rows))
        for r in rows:
            for x in r.get("sweep", []):
                print(f"sweep {r['case']}: config {x['config']} " + (x["error"] if "error" in x else
                      f"{fmt(x['us'], x['tflops'])} err {x['max_abs_err_vs_portable']:.3g}"))
    if a.host:
        result["host_us_per_layer_call"] = host_us()
        print("host us per planned layer call:", json.dumps(result["host_us_per_layer_call"]))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
