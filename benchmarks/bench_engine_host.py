"""The engine's own host work per decode step: `hwkv.engine.engine.Engine` over a model that returns zero logits.

The model does no attention, so what is timed is the step around it: scheduling, the forward's one host copy and
allocation, the metadata step, sampling, reading the tokens back, the release rule. It runs on the CPU by default
(where the metadata step builds the CPU backend's lists) or on any device torch has (`--device`).

    python3 benchmarks/bench_engine_host.py [--batch-sizes 1,64,256] [--steps 200] [--device cpu] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hwkv.engine.engine import Engine  # noqa: E402
from hwkv.engine.pools import build_cache, plan_pools  # noqa: E402
from hwkv.engine.presets import get_preset  # noqa: E402
from hwkv.engine.sampling import SamplingParams  # noqa: E402
from hwkv.engine.stats import RunnerStats  # noqa: E402

VOCAB = 64


def step_us(bs: int, steps: int, device: str, rounds: int = 3) -> float:
    """Median over `rounds` of the microseconds per decode step of `bs` running requests (after three warm-up
    steps), GPT-OSS-20B's head geometry with one SWA and one full layer, page 16."""
    dev = torch.device(device)
    shape = replace(get_preset("gpt-oss-20b"), layer_is_swa=(True, False))
    need = 40 + (rounds * steps + 8)
    plan = plan_pools(shape, context=need + 16, max_running=bs, chunk=max(4096, 40 * bs), page_size=16,
                      memory=None, device=dev)
    cache = build_cache(shape, plan, torch.float32, dev)

    def model(batch, ids, pos, keep):  # zero logits: the step's host work without a model
        n = ids.shape[0] if isinstance(keep, int) else keep.shape[0]
        return torch.zeros(n, VOCAB, device=dev)

    eng = Engine(cache, model, stats=RunnerStats(shape, plan), vocab_size=VOCAB, window=shape.window,
                 prefix_cache=False)
    for i in range(bs):
        eng.add_request([1 + (i + j) % 50 for j in range(40)], SamplingParams(max_new_tokens=need - 40))
    for _ in range(3):
        eng.step()
    runs = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        runs.append((time.perf_counter() - t) * 1e6 / steps)
    return statistics.median(runs)


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the zero model needs none)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(list(argv) or None)
    torch.set_num_threads(args.threads)
    rows: List[Dict] = []
    print("| batch | engine host us per decode step |\n| ---: | ---: |")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        us = step_us(bs, args.steps, args.device)
        rows.append(dict(batch=bs, step_us=round(us, 1), device=args.device, steps=args.steps))
        print(f"| {bs} | {us:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(bench="engine-host", rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
