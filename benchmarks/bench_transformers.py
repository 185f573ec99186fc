"""Tokens/s of hwkv's HybridRunner against transformers' own generation on the same model and prompts.

    python benchmarks/bench_transformers.py --tiny                 # CPU: a tiny GPT-OSS-shaped model, seconds
    python benchmarks/bench_transformers.py                        # CUDA: GPT-OSS-20B attention shapes, 4 layers

Random weights (GPT-OSS config: hidden 2880, 64/8 heads of 64, sliding window 128 on every other layer,
sinks, 32 experts top-4 unless --experts), greedy, every request generating exactly --new tokens (no stop
token). Per batch size (--batch-sizes, default 1,32) it times, after one untimed warm-up run each:
  hwkv            HybridRunner.generate (continuous batching, chunked prefill, graphs where the device has them)
  hf-generate     model.generate over the batch at once, transformers' default cache (DynamicCache)
  hf-cb           model.generate_batch (continuous batching, paged cache), where this transformers has it
tokens/s = batch x new tokens / wall seconds of the whole call (prefill included); decode tokens/s =
batch x (new - 1) / (seconds with new tokens - seconds with 1 token), the same subtraction for every method
(n/a when per-call overhead makes the 1-token run no faster). A method whose requests fail or stop short
reports the error instead of a time. hwkv's KV memory at its peak is printed beside an all-full cache of
the same tokens. --json prints one object.

--tiny is a smoke run sized to itself (about 10 s and 0.5 GB on a 2-core CPU): a 4-layer model with W=8,
prompts of 32, 16 new tokens, batch sizes 1 and 8, one timed run per length, one CPU thread, hwkv at page 4
prefilling the whole batch's prompts in one forward as generate() does (--chunk 16 measures chunked prefill:
at batch 32 that is 64 prefill forwards against generate()'s one), and every cache sized to the run: hwkv's
pools by default, transformers' paged cache --cb-blocks pages (by default what the batch needs) instead of
half the free memory, which on a 24 GiB machine took most of a minute and gigabytes of RAM to set up.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from hwkv.bench.serve import continuous_batching_config
from hwkv.integrations.transformers import HybridRunner, SamplingParams


def build_model(args: argparse.Namespace, device: str) -> Any:
    """A random-weight GPT-OSS causal LM: tiny, or GPT-OSS-20B's attention shapes with fewer layers."""
    from hwkv.bench.serve import random_gpt_oss

    return random_gpt_oss(device, args.tiny, args.layers, args.experts)


def _sync(device: str) -> None:
    if device != "cpu":
        getattr(torch, device).synchronize()


def _seconds(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def measure(run: Callable[[int], None], new: int, device: str, repeats: int) -> Dict[str, float]:
    """run(new) once untimed (compilation, graph capture, autotuning), then `repeats` timed runs each with 1
    and with `new` tokens, alternating: median end-to-end seconds, and decode seconds as the difference of
    the medians (prefill and first token cancel)."""
    run(new)
    t1, tn = [], []
    for _ in range(repeats):
        t1.append(_seconds(lambda: run(1), device))
        tn.append(_seconds(lambda: run(new), device))
    m1, mn = statistics.median(t1), statistics.median(tn)
    return {"seconds": mn, "seconds_1_token": m1, "decode_seconds": mn - m1,
            "runs_1_token": t1, "runs": tn}


def _check(outputs: List[List[int]], n: int, method: str) -> None:
    """Every request generated exactly n tokens (a failed or truncated request must not look fast)."""
    short = [i for i, o in enumerate(outputs) if len(o) != n]
    if short:
        raise RuntimeError(f"{method}: {len(short)} of {len(outputs)} requests did not generate {n} tokens "
                           f"(first: request {short[0]} with {len(outputs[short[0]])})")


def hwkv_method(model: Any, prompts: List[List[int]], new: int, device: str, args: argparse.Namespace,
                overlap: Optional[bool] = None) -> Dict:
    chunk = args.chunk or len(prompts) * len(prompts[0])  # tiny default: the batch's prompts in one forward
    # no prefix cache: the warm-up and every timed run generate from the same prompts, and generate() prefills each
    # call's whole prompt, so hwkv's must too (with the cache, the timed runs matched 28 of 32 prompt tokens in --tiny)
    with HybridRunner(model, max_running=len(prompts), context=len(prompts[0]) + new, chunk=chunk,
                      page_size=args.page_size, graphs=args.graphs, overlap=overlap, prefix_cache=False) as runner:
        def run(n: int) -> None:
            _check([r.tokens for r in runner.generate(prompts, SamplingParams(max_new_tokens=n))], n, "hwkv")

        res = measure(run, new, device, args.repeats)
        s = runner.stats
        res.update(graphs=runner.graph is not None, graph_error=s.graph_error, kv_held_bytes=s.peak_held_bytes,
                   kv_all_full_bytes=s.peak_all_full_bytes, kv_saving=s.saving)
        return res


def hf_generate_method(model: Any, prompts: List[List[int]], new: int, device: str, args: argparse.Namespace) -> Dict:
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        _check(out[:, ids.shape[1]:].tolist(), n, "hf-generate")

    return {**measure(run, new, device, args.repeats), "attn_implementation": model.config._attn_implementation}


def hf_cb_method(model: Any, prompts: List[List[int]], new: int, device: str, args: argparse.Namespace) -> Dict:
    """generate_batch with one persistent manager (warmed up once). Its default cache takes 90% of free memory
    and its eager-paged prefill of 32 x 512 tokens then ran out of memory on an H200, so the cache gets
    --cb-memory of free memory and a forward at most --cb-batch-tokens tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    blocks = args.cb_blocks
    if blocks is None and args.tiny:  # what this batch needs, plus one page per request
        blocks = len(prompts) * (-(-(len(prompts[0]) + new) // args.cb_page_size) + 1)
    # no block (prefix) sharing across the runs' identical prompts, as hwkv's runner runs without its prefix cache;
    # (releases without the switch keep their default)
    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    no_sharing = {"allow_block_sharing": False} if "allow_block_sharing" in fields else {}
    if blocks is not None:
        cbc = continuous_batching_config(ContinuousBatchingConfig, args.cb_page_size, num_blocks=blocks,
                                         max_batch_tokens=args.cb_batch_tokens, **no_sharing)
    else:
        cbc = ContinuousBatchingConfig(max_memory_percent=args.cb_memory, max_batch_tokens=args.cb_batch_tokens,
                                       **no_sharing)

    def run(n: int) -> None:
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
        out = model.generate_batch(inputs=prompts, generation_config=cfg, continuous_batching_config=cbc,
                                   persistent_manager=True, progress_bar=False)
        errors = [r.error for r in out.values() if r.error]
        if errors or len(out) != len(prompts):
            raise RuntimeError(f"hf-cb: {len(prompts) - len(out) + len(errors)} requests failed: "
                               f"{errors[0] if errors else 'missing results'}")
        _check([r.generated_tokens for r in out.values()], n, "hf-cb")

    try:
        return {**measure(run, new, device, args.repeats), "attn_implementation": model.config._attn_implementation}
    finally:
        model.destroy_cached_continuous_batching_manager()


def hwkv_sync_method(model: Any, prompts: List[List[int]], new: int, device: str, args: argparse.Namespace) -> Dict:
    """hwkv with the host waiting for each step's tokens (overlap off): what the overlapped loop saves."""
    return hwkv_method(model, prompts, new, device, args, overlap=False)


METHODS = {"hwkv": hwkv_method, "hwkv-sync": hwkv_sync_method, "hf-generate": hf_generate_method,
           "hf-cb": hf_cb_method}


def _free(device: str) -> None:
    gc.collect()
    if device != "cpu":
        getattr(torch, device).empty_cache()


def run_method(name: str, method: Callable[..., Dict], model: Any, prompts: List[List[int]], new: int, device: str,
               args: argparse.Namespace) -> Dict:
    """One method at one batch size, as a row (its error instead of times when it fails); printed unless --json."""
    bs = len(prompts)
    try:
        res = method(model, prompts, new, device, args)
    except Exception as e:  # reported in its row and printed: one method failing leaves the others' rows
        row = {"method": name, "batch": bs, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"{name:12s} bs={bs:<3d} FAILED {row['error']}", file=sys.stderr, flush=True)
        return row
    finally:
        _free(device)
    decode = bs * (new - 1) / res["decode_seconds"] if res["decode_seconds"] > 0 else None
    res.update(method=name, batch=bs, tokens_per_s=bs * new / res["seconds"], decode_tokens_per_s=decode)
    if not args.json:
        extra = f"  KV held {res['kv_held_bytes'] / 2**20:.2f} MiB vs all-full " \
                f"{res['kv_all_full_bytes'] / 2**20:.2f} MiB, graphs {res['graphs']}" if name.startswith("hwkv") else ""
        dec = f"{decode:9.1f}" if decode is not None else "  n/a (1-token run was not faster)"
        print(f"{name:12s} bs={bs:<3d} {res['seconds']:8.3f} s  {res['tokens_per_s']:9.1f} tokens/s  "
              f"decode {dec} tokens/s{extra}", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU, caches sized to the run (seconds)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32, help="experts per MoE layer (GPT-OSS-20B: 32)")
    p.add_argument("--batch-sizes", default=None, help="default 1,32 (tiny: 1,8)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 512 (tiny: 32)")
    p.add_argument("--new", type=int, default=None, help="new tokens per request; default 128 (tiny: 16)")
    p.add_argument("--chunk", type=int, default=None, help="hwkv: prefill tokens per forward; default 8192 (tiny: the "
                   "batch's prompts, one forward)")
    p.add_argument("--page-size", type=int, default=None, help="hwkv: tokens per page; default 16 (tiny: 4)")
    p.add_argument("--graphs", default="auto", choices=("auto", "on", "off", "eager"))
    p.add_argument("--repeats", type=int, default=None, help="timed runs per length (median); default 3 (tiny: 1)")
    p.add_argument("--cb-memory", type=float, default=0.5, help="hf-cb: fraction of free memory for its cache "
                   "(without --cb-blocks)")
    p.add_argument("--cb-blocks", type=int, default=None, help="hf-cb: pages in its cache (default: --cb-memory; "
                   "tiny: what the batch needs)")
    p.add_argument("--cb-page-size", type=int, default=16, help="hf-cb: tokens per page with --cb-blocks")
    p.add_argument("--cb-batch-tokens", type=int, default=2048, help="hf-cb: tokens per forward at most")
    p.add_argument("--skip", default="hwkv-sync", help="comma-separated methods to skip (hwkv, hwkv-sync: hwkv with "
                   "overlap off, hf-generate, hf-cb); default hwkv-sync")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads; tiny: 1, which "
                   "tiny matmuls run fastest on, and steadiest on a shared machine)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    threads = args.threads or (1 if args.tiny else None)
    if threads:
        torch.set_num_threads(threads)
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    prompt_len = args.prompt_len or (32 if args.tiny else 512)
    new = args.new or (16 if args.tiny else 128)
    args.repeats = args.repeats or (1 if args.tiny else 3)
    args.chunk = args.chunk or (None if args.tiny else 8192)
    args.page_size = args.page_size or (4 if args.tiny else 16)
    args.batch_sizes = args.batch_sizes or ("1,8" if args.tiny else "1,32")
    model = build_model(args, device)
    vocab = model.config.vocab_size
    has_cb = hasattr(model, "generate_batch")  # transformers' continuous batching (paged cache)
    skip = set(filter(None, args.skip.split(",")))
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        g = torch.Generator().manual_seed(bs)
        prompts = torch.randint(1, vocab, (bs, prompt_len), generator=g).tolist()
        for name, method in METHODS.items():
            if name not in skip and (name != "hf-cb" or has_cb):
                rows.append(run_method(name, method, model, prompts, new, device, args))
    setup = {"device": device, "dtype": str(model.dtype), "layers": args.layers, "tiny": args.tiny,
             "prompt_len": prompt_len, "new_tokens": new, "threads": torch.get_num_threads(),
             "batch_sizes": args.batch_sizes, "repeats": args.repeats, "page_size": args.page_size,
             "chunk": args.chunk or "batch x prompt_len", "hf_continuous_batching": has_cb}
    if args.json:
        print(json.dumps({"schema": "hwkv-bench-transformers/1", "setup": setup, "rows": rows}, indent=2))
    else:
        print(json.dumps(setup))


if __name__ == "__main__":
    main()
