"""Launch-config sweeps behind the recorded decode and extend configs (one CUDA GPU).

    python3 benchmarks/sweep_cuda_configs.py OUT.jsonl decode|small|extend|ab SECONDS

decode: every decode cell of bench_cuda_kernels against a grid of DecodeConfigs (kv heads per
program, key tile, stages, warps, target CTAs per SM), the 12 best per cell; extend: window-list
prefill (W=128) over tile sizes, warps, stages and one_loop, and a few causal tile shapes; ab: the
candidate configs side by side on every cell (the table in docs/benchmarks.md); small: the small-batch cells (many
splits, the merge kernel) over split caps, key tiles and CTA targets, each with the merge kernel a programmatic
dependent of the split kernel (PDL) and without. Each cell appends
one JSON line to OUT.jsonl as it finishes; SECONDS bounds the decode and extend sweeps.
"""
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_cuda_kernels as B  # noqa: E402
from hwkv_cuda.kernels import DecodeConfig, ExtendConfig  # noqa: E402

if len(sys.argv) != 4 or sys.argv[2] not in ("decode", "small", "extend", "ab"):
    sys.exit(__doc__)
out = Path(sys.argv[1])
section = sys.argv[2]
budget = float(sys.argv[3])
t_end = time.time() + budget
f = out.open("a")


def emit(d):
    f.write(json.dumps(d) + "\n")
    f.flush()
    print(json.dumps(d), flush=True)


def sweep_decode(cfgs, cases):
    """Every DecodeConfig in cfgs on every (batch, context, window) cell: one line per cell, its 12 best."""
    copy_bw = B.copy_bandwidth()
    emit(dict(copy_bw=copy_bw))
    for bs, ctx, window in cases:
        if time.time() > t_end:
            break
        s = B.DecodeSetup(bs, ctx, window)
        sd = s.time_sdpa()
        base, splits = s.time()
        res = []
        for cfg in cfgs:
            if time.time() > t_end:
                break
            try:
                us, sp = s.time(cfg)
                res.append((us, sp, repr(cfg)))
            except Exception as e:  # noqa: BLE001
                res.append((float("inf"), 0, f"{cfg!r}: {type(e).__name__} {e}"[:300]))
        res.sort()
        emit(dict(case=[bs, ctx, window], sdpa_us=sd, default_us=base, default_splits=splits,
                  frac_copy=s.bytes / (base * 1e-6) / copy_bw, best=res[:12],
                  best_hpp1=[r for r in res if "heads_per_program=1" in r[2]][:3]))
        del s
        torch.cuda.empty_cache()


if section == "decode":
    sweep_decode([DecodeConfig(block_n=bn, mid_block_n=bn, num_warps=w, num_stages=st, ctas_per_sm=c,
                               min_keys_per_split=128, heads_per_program=hpp)
                  for hpp in (1, 2) for bn, st in ((64, 3), (128, 2), (128, 3), (128, 4), (256, 2))
                  for w in (4, 8) for c in (2, 4, 8)],
                 [(64, 4096, None), (64, 32768, None), (16, 4096, None), (16, 32768, None), (256, 4096, None),
                  (256, 32768, None), (1, 32768, None), (256, 32768, 128), (1, 4096, None)])

if section == "small":
    sweep_decode([DecodeConfig(block_n=bn, mid_block_n=bn, num_warps=4, num_stages=st, ctas_per_sm=c,
                               min_keys_per_split=64, max_splits=ms, heads_per_program=hpp, pdl=pdl)
                  for hpp in (1, 2) for bn, st in ((64, 3), (128, 2), (128, 3)) for c in (2, 4) for ms in (64, 128)
                  for pdl in (True, False)],
                 [(1, 32768, None), (1, 4096, None), (4, 32768, None), (16, 4096, None)])

if section == "extend":
    cfgs = [ExtendConfig(bm, bn, w, st, ol) for ol in (False, True) for bm in (32, 64, 128) for bn in (16, 32, 64)
            for w, st in ((4, 2), (4, 3), (2, 2))]
    for bs, new, prefix, window in ((1, 8192, 0, 128), (1, 2048, 30720, 128), (8, 1024, 0, 128)):
        if time.time() > t_end:
            break
        s = B.ExtendSetup(bs, new, prefix, window)
        base = s.time()
        res = []
        for cfg in cfgs:
            if time.time() > t_end:
                break
            try:
                res.append((s.time(cfg), repr(cfg)))
            except Exception as e:  # noqa: BLE001
                res.append((float("inf"), f"{cfg!r}: {type(e).__name__}"))
        res.sort()
        emit(dict(case=[bs, new, prefix, window], default_us=base, rel_err=s.check(), best=res[:10]))
        del s
        torch.cuda.empty_cache()
    causal = [ExtendConfig(128, 128, 4, 2), ExtendConfig(128, 64, 4, 3), ExtendConfig(256, 64, 8, 2),
              ExtendConfig(256, 128, 8, 2), ExtendConfig(256, 64, 8, 3), ExtendConfig(128, 128, 8, 2),
              ExtendConfig(128, 128, 8, 3), ExtendConfig(128, 64, 8, 2)]
    for bs, new, prefix in ((1, 8192, 0), (8, 1024, 0)):
        if time.time() > t_end:
            break
        s = B.ExtendSetup(bs, new, prefix, None)
        res = []
        for cfg in causal:
            try:
                us = s.time(cfg)
                res.append((us, s.tflops(us), repr(cfg)))
            except Exception as e:  # noqa: BLE001
                res.append((float("inf"), 0, f"{cfg!r}: {type(e).__name__}"))
        res.sort()
        emit(dict(case=[bs, new, prefix, None], default_us=s.time(), flash=s.sdpa(B.SDPBackend.FLASH_ATTENTION),
                  best=res))
        del s
        torch.cuda.empty_cache()

if section == "ab":
    copy_bw = B.copy_bandwidth()
    def dc(hpp, bn, st, c, mid=None, w=4):
        return DecodeConfig(block_n=bn, mid_block_n=mid or bn, num_warps=w, num_stages=st, ctas_per_sm=c,
                            min_keys_per_split=128, heads_per_program=hpp)
    cfgs = {"base": DecodeConfig(), "h2s3c2": dc(2, 128, 3, 2), "h2s2c2": dc(2, 128, 2, 2), "h2s4c2": dc(2, 128, 4, 2),
            "h2s3c1": dc(2, 128, 3, 1), "h2b64s3c2": dc(2, 64, 3, 2), "h4b64s2c2": dc(4, 64, 2, 2),
            "h4b64s3c2": dc(4, 64, 3, 2), "h4b32s3c2": dc(4, 32, 3, 2), "h2s3c4": dc(2, 128, 3, 4),
            "h2s3c2m64": dc(2, 128, 3, 2, 64), "h2s2c2m64": dc(2, 128, 2, 2, 64)}
    cases = [(16, 4096, None), (64, 4096, None), (256, 4096, None), (16, 32768, None), (64, 32768, None),
             (256, 32768, None), (1, 32768, None), (1, 4096, None), (1, 32768, 128), (256, 32768, 128)]
    for bs, ctx, window in cases:
        s = B.DecodeSetup(bs, ctx, window)
        row = dict(case=[bs, ctx, window], sdpa_us=s.time_sdpa())
        for name, cfg in cfgs.items():
            try:
                us, sp = s.time(cfg)
                row[name] = [round(us, 2), sp]
            except Exception as e:  # noqa: BLE001
                row[name] = f"{type(e).__name__} {e}"[:200]
        emit(row)
        del s
        torch.cuda.empty_cache()
    E = ExtendConfig
    ecfgs = {"c128_128": E(128, 128, 4, 2), "c128_128_m64": E(128, 128, 4, 2, mask32=False),
             "c128_64": E(128, 64, 4, 3), "c128_64_m64": E(128, 64, 4, 3, mask32=False),
             "w64_32_one": E(64, 32, 4, 2, True), "w64_32_one_m64": E(64, 32, 4, 2, True, False),
             "w64_32": E(64, 32, 4, 2), "w64_32_m64": E(64, 32, 4, 2, mask32=False)}
    for bs, new, prefix, window in ((1, 8192, 0, None), (8, 1024, 0, None), (4, 2048, 2048, None),
                                    (1, 2048, 30720, None), (1, 8192, 0, 128), (4, 2048, 2048, 128),
                                    (8, 1024, 0, 128), (1, 2048, 30720, 128)):
        s = B.ExtendSetup(bs, new, prefix, window)
        row = dict(case=[bs, new, prefix, window])
        for name, cfg in ecfgs.items():
            if (window is None) != name.startswith("c"):
                continue
            us = s.time(cfg)
            row[name] = [round(us, 1), round(s.tflops(us), 1)]
        emit(row)
        del s
        torch.cuda.empty_cache()
