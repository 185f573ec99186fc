"""`hwkv generate`: a local Hugging Face model generating through hwkv's hybrid cache.

The prompt is text when the model folder has a tokenizer, otherwise comma- or space-separated token ids.
Prints each output, tokens/s and the KV memory held against an all-full cache (`--json`: one object,
schema `hwkv-generate/1`). transformers is imported only when the command runs.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import sys
import time
from typing import Any, List, Optional, Tuple

from hwkv.errors import BudgetError, ConfigError, HwkvError, OutOfSlotsError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
EXIT_OK, EXIT_ERROR = 0, 2
NUM_DRAFT = 4  # draft tokens per request per verify, with --draft


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """The `generate` flags."""
    p.epilog = "example: hwkv generate --model ./tiny-gpt-oss --prompt '1,2,3' --max-new-tokens 16"
    p.add_argument("--model", required=True, metavar="PATH",
                   help="a local model folder (config + weights), or a name already in the local HF cache")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (token ids '1,2,3' when the folder has no tokenizer); repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--device", metavar="NAME", help="hwkv device plugin (default: the detected one)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="weights and KV dtype (default: fp32 on CPU, the config's dtype elsewhere)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt; prompt i uses seed + i")
    p.add_argument("--memory", help="KV memory budget, e.g. 2GiB (default: what the batch needs, capped at "
                                    "80%% of an accelerator's free memory, or on the CPU a quarter of the available "
                                    "RAM and at most 4 GiB)")
    p.add_argument("--context", type=int, help="KV tokens the cache holds per request (default: the longest prompt + "
                   "--max-new-tokens - 1, at most a learned position table's length); a prompt that needs more is "
                   "refused with its error, the others run")
    p.add_argument("--max-running", type=int, help="concurrent requests (default and most: every prompt at once; one with "
                   "--conversation, whose turns run one after another)")
    p.add_argument("--chunk", type=int, default=512, help="prefill tokens per forward (default 512)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--graphs", choices=("auto", "on", "off", "eager"), default="auto",
                   help="decode graph replay: auto = the device's graphs, none on CPU (default)")
    p.add_argument("--conversation", action="store_true", help="the prompts are the user turns of one conversation: "
                   "turn i is the conversation so far (earlier turns and their replies) plus prompt i, run after "
                   "turn i - 1 finished; with the prefix cache each turn computes only its new tokens")
    p.add_argument("--no-prefix-cache", action="store_true", help="no prefix caching (by default prompts sharing a "
                   "prefix with an earlier one, e.g. a system prompt, take its KV from the cache)")
    p.add_argument("--draft", choices=("prompt-lookup",), help="speculative verify with this drafter: prompt-lookup "
                   "proposes the tokens that followed the last n-gram's earlier occurrence (greedy requests only; "
                   "the tokens stay greedy decoding's)")
    p.add_argument("--num-draft", type=int, default=None, help="draft tokens per request per verify, with --draft "
                   f"(default {NUM_DRAFT})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema hwkv-generate/1)")


def parse_token_ids(text: str, vocab_size: int) -> List[int]:
    """'1,2,3' or '1 2 3' -> [1, 2, 3]; ConfigError names a bad or empty item ('1,,2') or an id outside the
    vocabulary."""
    if not text.strip():
        raise ConfigError("the prompt is empty (give token ids like '1,2,3': the model folder has no tokenizer)")
    items = re.split(r"\s*,\s*|\s+", text.strip())
    if "" in items:
        raise ConfigError(f"the prompt {text!r} has an empty item; give token ids like '1,2,3' (the model folder "
                          "has no tokenizer)")
    ids = []
    for s in items:
        if not re.fullmatch(r"\d+", s):
            raise ConfigError(f"prompt item {s!r} is not a token id; the model folder has no tokenizer, so the "
                              "prompt must be comma- or space-separated integers")
        if len(s.lstrip("0")) > len(str(vocab_size)) or int(s) >= vocab_size:  # (int() refuses 4,300+ digits)
            shown = s if len(s) <= 24 else f"{s[:12]}... ({len(s)} digits)"
            raise ConfigError(f"token id {shown} is outside the vocabulary [0, {vocab_size})")
        ids.append(int(s))
    return ids


def _stop_tokens(model: Any) -> Tuple[int, ...]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _check_args(args: argparse.Namespace) -> None:
    """Refuse bad flag values before the model loads (seconds), each naming the flag, its value and the limit."""
    from hwkv.engine.plan import check_flag_minimums, parse_bytes
    from hwkv.engine.sampling import F32_MAX

    check_flag_minimums((("--max-new-tokens", args.max_new_tokens, 1), ("--max-running", args.max_running, 1),
                         ("--context", args.context, 1), ("--chunk", args.chunk, 1),
                         ("--page-size", args.page_size, 1), ("--seed", args.seed, 0),
                         ("--num-draft", args.num_draft, 1)))
    last = 2**32 - len(args.prompt)  # prompt i samples with seed + i, each below 2**32 (SamplingParams)
    if args.seed > last:
        raise ConfigError(f"--seed must be in [0, {last}] with {len(args.prompt)} prompt(s) (prompt i samples with "
                          f"seed + i, below 2**32), got {args.seed}")
    if not 0 <= args.temperature <= F32_MAX:   # the sampler's limit (SamplingParams), named as the flag
        raise ConfigError(f"--temperature must be a number in [0, {F32_MAX!r}] (0 = greedy; the sampler reads it "
                          f"as float32), got {args.temperature}")
    if args.num_draft is not None and args.num_draft >= 2**63:   # the engine's limit (token counts are int64)
        raise ConfigError(f"--num-draft must be below 2**63, got {args.num_draft}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.memory is not None:
        parse_bytes(args.memory)
    for i, p in enumerate(args.prompt):
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:  # bytes the terminal's encoding did not decode (kept as lone surrogates)
            raise ConfigError(f"--prompt [{i}] {p!r} holds bytes that are not UTF-8 text (the terminal's encoding?)") \
                from None
    if args.num_draft is not None and not args.draft:
        raise ConfigError(f"--num-draft {args.num_draft} needs --draft (no drafter runs without it)")
    if args.draft and args.temperature > 0:  # (the engine drafts for greedy requests only: none would be drafted)
        raise ConfigError(f"--draft {args.draft} verifies greedy decoding only: --temperature {args.temperature} "
                          "would run with no draft token (drop one of them)")


def _looks_like_path(name: str) -> bool:
    """A local path rather than a Hugging Face repo id ('org/name'): absolute, relative to . or ~, or deeper."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.endswith("/") or name.count("/") > 1


def check_model_path(name: str) -> None:
    """A model given as a path must be a folder with a config.json: say which of those it is not."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ConfigError(f"cannot load model {name!r}: the folder has no config.json (not a Hugging Face "
                              "model folder)")
    elif os.path.exists(path):
        raise ConfigError(f"cannot load model {name!r}: it is a file; give the model's folder (config.json and "
                          "weights)")
    elif _looks_like_path(name):
        raise ConfigError(f"cannot load model {name!r}: no such folder")


def load_local_model(name: str, device: str, dtype: Optional[str] = None, tokenizer: bool = False) -> Tuple[Any, Any]:
    """(model, tokenizer or None) from a local model folder or a name in the local Hugging Face cache (nothing is
    downloaded): the loading path of `hwkv generate` and `hwkv bench --workload serve`. Whatever stops the model
    (`load_model`'s typed errors) or, with `tokenizer`, the folder's tokenizer from loading, e.g. a truncated
    safetensors file or a broken tokenizer.json, is a ConfigError naming the model and the error's first line."""
    from hwkv.integrations.transformers import load_model

    check_model_path(name)
    folder = os.path.expanduser(name)
    model = load_model(name, device=device, dtype=dtype)
    if not tokenizer or not (os.path.isdir(folder) and any(os.path.exists(os.path.join(folder, f))
                                                           for f in TOKENIZER_FILES)):
        return model, None
    from transformers import AutoTokenizer

    try:
        return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:
        raise ConfigError(f"cannot load model {name!r}: its tokenizer: {_first_line(e)}") from e


def _load(args: argparse.Namespace) -> Tuple[Any, Any, Any]:
    """(device spec, model, tokenizer or None)."""
    from hwkv.integrations.device_choice import available_spec

    spec = available_spec(args.device)
    check_model_path(args.model)
    dtype = args.dtype or ("fp32" if spec.torch_device == "cpu" else None)
    if args.no_progress:  # transformers' own "Loading weights" bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    model, tokenizer = load_local_model(args.model, spec.torch_device, dtype, tokenizer=True)
    return spec, model, tokenizer


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _error_text(res: Any) -> Optional[str]:
    """A refused prompt's error as '<type>: <message>'. A prompt refused before it was queued never got a
    request id (its Result's rid is -1), so the 'request N: ' its message starts with is dropped: the CLI
    names prompts by their index."""
    if res.error is None:
        return None
    msg = str(res.error)
    if res.rid < 0:
        msg = re.sub(r"^request -?\d+: ", "", msg)
    return f"{type(res.error).__name__}: {msg}"


def _progress(enabled: bool, total: int) -> Tuple[Any, Any]:
    """A rich progress bar on stderr (or a no-op) and its advance function."""
    if not enabled or importlib.util.find_spec("rich") is None:
        return None, lambda n: None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task("tokens", total=total)
    return bar, lambda n: bar.advance(task, n)


def _generate(args: argparse.Namespace) -> Tuple[dict, int]:
    """Load, run every prompt, and return the JSON-ready result and the exit code."""
    from hwkv.engine.drafters import prompt_lookup
    from hwkv.integrations.hf_model import position_limit
    from hwkv.integrations.transformers import HybridRunner, SamplingParams

    spec, model, tokenizer = _load(args)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    prompts = [tokenizer.encode(p) if tokenizer is not None else parse_token_ids(p, vocab) for p in args.prompt]
    stops = _stop_tokens(model)
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed + i, stop_token_ids=stops) for i in range(len(prompts))]
    if args.conversation:  # every turn in one context: all the user turns and every reply
        longest = sum(len(p) for p in prompts) + len(prompts) * args.max_new_tokens
    else:  # (at least 1: an empty prompt is refused as one, not as a context of 0)
        longest = max(1, max(len(p) for p in prompts) + args.max_new_tokens - 1)
    positions = position_limit(model)  # never past a learned position table: a prompt needing more is refused
    context = args.context if args.context is not None else min(longest, positions or longest)
    # never more running requests than can run at once: the pools are sized (and allocated) for them
    most = 1 if args.conversation else len(prompts)
    running = most if args.max_running is None else min(args.max_running, most)
    try:
        runner = HybridRunner(model, device=spec.name, memory=args.memory, context=context, max_running=running,
                              chunk=args.chunk, page_size=args.page_size,
                              graphs=args.graphs, prefix_cache=not args.no_prefix_cache,
                              draft=prompt_lookup() if args.draft else None, num_draft=args.num_draft or NUM_DRAFT)
    except BudgetError as e:  # say which flags sized it: the message names only the context and the budget
        raise BudgetError(f"{e} ({_budget_flags(args, context)})") from None
    with runner:
        bar, advance = _progress(not args.no_progress, args.max_new_tokens * len(prompts))
        t0 = time.perf_counter()
        not_run = None  # why the turns after a refused one did not run (a conversation)
        with bar if bar is not None else contextlib.nullcontext():
            if args.conversation:
                results, history = [], []
                for i, (turn, p) in enumerate(zip(prompts, params)):
                    prompts[i] = history + turn  # what this turn sends: the conversation so far
                    (res,) = runner.generate([prompts[i]], p, on_step=advance)
                    results.append(res)
                    if res.error is not None:  # the later turns continue this one: none of them can run
                        not_run = f"not run: turn [{i}] was refused ({type(res.error).__name__}), and this turn " \
                                  "continues it"
                        break
                    history = prompts[i] + res.tokens
            else:
                results = runner.generate(prompts, params, on_step=advance)
        wall = time.perf_counter() - t0
        stats = runner.stats
    capped = args.context is None and context < longest  # a refusal's "context" is then the model's positions
    rows = []
    for text, ids, res in zip(args.prompt, prompts, results):
        error = _error_text(res)
        if capped and isinstance(res.error, OutOfSlotsError):
            error += f" (the context stops at the model's {positions} positions: a learned position table)"
        rows.append({"prompt": text, "prompt_ids": ids, "tokens": res.tokens, "finish_reason": res.finish_reason,
                     "text": tokenizer.decode(res.tokens) if tokenizer is not None and res.error is None else None,
                     "error": error})
    for text, ids in list(zip(args.prompt, prompts))[len(results):]:  # every prompt is listed, run or not
        rows.append({"prompt": text, "prompt_ids": ids, "tokens": [], "finish_reason": None, "text": None,
                     "error": not_run})
    data = {"schema": "hwkv-generate/1", "model": args.model, "device": spec.name, "dtype": str(model.dtype),
            "backend": type(runner.cache.backend).__name__, "graphs": runner.graph is not None,
            # "eager": the graph path's static buffers, the step called (no device graph recorded)
            "graph_mode": None if runner.graph is None else ("eager" if args.graphs == "eager" else "device"),
            "wall_seconds": wall, "results": rows, "stats": stats.as_dict(), "memory": stats.memory_line(),
            "prefix_cache": runner.prefix is not None, "prefix": stats.prefix_line(),
            "draft": stats.draft_line() if args.draft else None}
    return data, EXIT_ERROR if any(r["error"] for r in rows) else EXIT_OK


def _budget_flags(args: argparse.Namespace, context: int) -> str:
    """The flags behind a refused memory budget: how the context was set, --page-size and --memory."""
    if args.context is not None:
        how = f"--context {context}"
    elif args.conversation:
        how = f"context {context}: every turn and --max-new-tokens {args.max_new_tokens} per reply"
    else:
        how = f"context {context}: the longest prompt + --max-new-tokens {args.max_new_tokens} - 1"
    budget = f"--memory {args.memory}" if args.memory else "the default budget; --memory sets it"
    return f"{how}; --page-size {args.page_size}; {budget}"


def _say(line: str) -> None:
    """print, with what stdout's encoding cannot hold escaped ('\\xe9') rather than a UnicodeEncodeError."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    print(line.encode(encoding, "backslashreplace").decode(encoding))


def _print_plain(data: dict) -> None:
    for i, r in enumerate(data["results"]):
        out = r["error"] or (r["text"] if r["text"] is not None else ",".join(map(str, r["tokens"])))
        why = "" if r["error"] else f"  [{len(r['tokens'])} tokens, {r['finish_reason']}]"
        _say(f"[{i}] {r['prompt']!r} -> {out}{why}")
    s = data["stats"]
    print(f"{s['generated_tokens']} tokens in {s['seconds']:.2f} s: {s['tokens_per_second']:.1f} tokens/s "
          f"({s['prefill_tokens']} prompt tokens computed; {data['device']}, {data['backend']}, "
          f"graphs {'off' if not data['graphs'] else 'eager' if data['graph_mode'] == 'eager' else 'on'})")
    if s["graph_error"]:
        print(f"decode ran eagerly: {s['graph_error']}")
    if data["prefix_cache"]:
        print(data["prefix"])
    if data["draft"]:
        print(data["draft"])
    print(data["memory"])


def run_generate(args: argparse.Namespace) -> int:
    """Run `hwkv generate`; exit 2 on a bad value, a model that cannot load, a refused prompt or a conversation
    turn that did not run (one after a refused turn: listed, with the reason)."""
    if importlib.util.find_spec("transformers") is None:
        print("hwkv generate: error: transformers is not installed (pip install 'hwkv[transformers]')",
              file=sys.stderr)
        return EXIT_ERROR
    try:
        _check_args(args)
        data, code = _generate(args)
    except HwkvError as e:
        print(f"hwkv generate: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_plain(data)
    for i, r in enumerate(data["results"]):
        if r["error"]:
            print(f"hwkv generate: error: prompt [{i}] {r['prompt']!r}: {r['error']}", file=sys.stderr)
    return code

