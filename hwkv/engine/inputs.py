"""What an engine's caller hands it, checked once at the boundary: prompts as token ids, graph bucket sizes, the
window its out-of-window release keeps.

Each refusal is a ConfigError naming the value, raised before the engine queues or builds anything.
"""
from __future__ import annotations

import operator
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from hwkv.checks import as_int, check_batch_sizes, is_bool, items_of, release_window as _release_window
from hwkv.engine.stats import RunnerStats
from hwkv.errors import ConfigError


def shown(value: Any) -> str:
    """A value's type and (shortened) repr, for messages."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def prompt_ids(prompt: Any) -> List[int]:
    """A prompt's token ids as ints: an iterable of integers (list, tuple, range, a generator, numpy integers) or a
    1-D integer numpy array or torch tensor. ConfigError naming what is not one (text, None, a float or bool id:
    int(1.7) would be 1, True would be token 1); the vocabulary is the caller's check."""
    return token_ids(prompt, "prompt")


def token_ids(value: Any, what: str) -> List[int]:
    """`value` as token ids by the prompt rule (`prompt_ids`); `what` names them in a refusal ("prompt",
    "draft")."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(value, torch.Tensor) else "array"
        if (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool) \
                if kind == "tensor" else value.dtype.kind not in "iu":
            raise ConfigError(f"a {what} {kind} must hold integers, got {value.dtype}")
        if value.ndim != 1:
            raise ConfigError(f"a {what} must be 1-D, got shape {list(value.shape)}")
        return value.tolist()
    items = items_of(value)
    if items is None:
        hint = ": tokenize text first" if what == "prompt" and isinstance(value, (str, bytes, bytearray)) else ""
        raise ConfigError(f"a {what} must be a sequence of token ids (a list, tuple, or 1-D integer array or "
                          f"tensor), got {shown(value)}{hint}")
    try:
        ids = [operator.index(t) for t in items]  # (which reads a torch bool as 0 or 1)
        if all(t.__class__ is int for t in items) or not any(map(is_bool, items)):
            return ids
    except TypeError:
        pass
    for i, t in enumerate(items):  # the refusal: name the first id that is no integer
        if as_int(t) is None:
            raise ConfigError(f"{what} token id {t!r} ({type(t).__name__}, at index {i}) is not an integer")
    raise AssertionError(f"unreachable: every {what} id is an integer")


def batch_sizes(value: Any) -> Optional[List[int]]:
    """`graph_batch_sizes` as ints (None: the default buckets); ConfigError unless each is an integer >= 1."""
    return None if value is None else check_batch_sizes("graph_batch_sizes", value, empty=True)


def release_window(window: Any, hybrid: bool, model_window: int, context: int, page_size: int,
                   name: str) -> Optional[int]:
    """The engine's `window` (what its out-of-window release and prefix cache keep) checked against its pools named
    `name`: the core's rule (`hwkv.checks.release_window`, which whole-step graphs check too)."""
    return _release_window(window, hybrid, model_window, context, page_size, repr(name))


def engine_args(model_step: Any, stats: Any, vocab_size: Any, draft: Any, num_draft: Any) -> Tuple[int, int]:
    """The engine's model, stats, vocab_size and drafting arguments checked (ConfigError naming the value and the
    limit); returns (vocab_size, num_draft) as ints."""
    if not callable(model_step):
        raise ConfigError(f"model_step must be callable (the model over a forward's tokens: see ModelStep), got "
                          f"{shown(model_step)}")
    if not isinstance(stats, RunnerStats):
        raise ConfigError(f"stats must be a RunnerStats, got {shown(stats)}")
    vocab = as_int(vocab_size)
    if vocab is None or not 1 <= vocab < 2**63:
        raise ConfigError(f"vocab_size={vocab_size!r} must be an integer >= 1 and < 2**63 (token ids are int64 in "
                          "[0, vocab_size))")
    if draft is not None and not callable(draft):
        raise ConfigError(f"speculative verify needs a callable draft ((tokens so far, k) -> up to k draft ids), got "
                          f"draft={draft!r}")
    k = as_int(num_draft)
    if k is None or not 1 <= k < 2**63:
        rule = "an integer >= 1 and < 2**63 (draft tokens per verify step)"
        raise ConfigError(f"speculative verify needs num_draft to be {rule}, got num_draft={num_draft!r}"
                          if draft is not None else f"num_draft={num_draft!r} must be {rule}, with a draft or without")
    return vocab, k
