"""Draft token proposers for the engine's speculative verify: any callable (tokens so far, k) -> up to k ids.

The engine verifies drafts with the target model in one forward and keeps the longest prefix greedy decoding
would have produced, so a drafter changes speed only, never the tokens. `prompt_lookup` is the model-free one
(draft tokens copied from an earlier occurrence of the sequence's last n-gram: repeats in the prompt, quoted
text, code); a draft model wraps its own generate in the same signature.

The engine hands a drafter each request's tokens as a `TokenHistory`, made once per request: a read-only sequence
over its prompt and outputs (no list built per step), whose int64 numpy copy grows by the new tokens only.
`prompt_lookup` searches that copy with numpy (a few vectorised compares per n-gram length, no Python per
token); what a drafter returns is checked by `draft_ids`.
"""
from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterator, List, Sequence, Union, overload

import numpy as np
import torch

from hwkv.checks import is_int
from hwkv.engine.inputs import shown, token_ids
from hwkv.errors import ConfigError

Drafter = Callable[[Sequence[int], int], Sequence[int]]


class TokenHistory(Sequence[int]):
    """A request's tokens so far, its prompt then its outputs, as a read-only sequence over the engine's own lists
    (which only grow; a drafter reads them, never the lists themselves): its length, an index, a slice (a list),
    iteration, equality with a list, `+` and `copy()` (lists). `array()` is an int64 numpy copy, read-only, extended
    by the tokens appended since its last call."""

    __slots__ = ("_prompt", "_output", "_buf", "_n")
    __hash__ = None  # type: ignore[assignment]  # compares by value, as the list it stands for

    def __init__(self, prompt: List[int], output: List[int]) -> None:
        self._prompt, self._output = prompt, output
        self._buf = np.empty(0, dtype=np.int64)
        self._n = 0  # tokens copied into _buf

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> List[int]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[int, List[int]]:
        p = len(self._prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return list(self)[i]
            if stop <= start:
                return []
            return self._prompt[start:min(stop, p)] + self._output[max(start - p, 0):max(stop - p, 0)]
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"token index {i} outside a history of {n} tokens")
        return self._prompt[j] if j < p else self._output[j - p]

    def __iter__(self) -> Iterator[int]:
        return chain(self._prompt, self._output)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenHistory):
            other = list(other)
        return isinstance(other, list) and len(other) == len(self) and list(self) == other

    def __add__(self, other: Sequence[int]) -> List[int]:
        return list(self) + list(other)

    def __radd__(self, other: Sequence[int]) -> List[int]:
        return list(other) + list(self)

    def copy(self) -> List[int]:
        """The tokens as a new list (what a drafter that edits its input should take)."""
        return list(self)

    def __repr__(self) -> str:
        return f"TokenHistory({len(self._prompt)} prompt + {len(self._output)} output tokens)"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.array()
        return a if dtype is None and not copy else np.array(a, dtype=dtype)

    def array(self) -> np.ndarray:
        """The tokens as a read-only int64 array: the tokens appended since the last call are copied, no more."""
        n = len(self)
        if n > self._n:
            if n > self._buf.shape[0]:  # grown geometrically: appends cost O(1) amortised
                buf = np.empty(max(n, 2 * self._buf.shape[0], 64), dtype=np.int64)
                buf[:self._n] = self._buf[:self._n]
                self._buf = buf
            p = len(self._prompt)
            if self._n < p:
                self._buf[self._n:p] = self._prompt[self._n:]
            start = max(self._n, p)
            self._buf[start:n] = self._output[start - p:n - p]
            self._n = n
        view = self._buf[:n]
        view.flags.writeable = False
        return view


def _as_array(tokens: Any) -> np.ndarray:
    """A drafter's input as an int64 array (a TokenHistory's own copy; anything else converted)."""
    if isinstance(tokens, TokenHistory):
        return tokens.array()
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().to("cpu", torch.int64).numpy()
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False)
    return np.array(list(tokens), dtype=np.int64)


def prompt_lookup(max_ngram: int = 3, min_ngram: int = 1) -> Drafter:
    """A drafter that finds the sequence's last n tokens (n from max_ngram down to min_ngram) earlier in it and
    proposes the k tokens that followed their latest earlier occurrence; nothing when no n-gram recurs. Each n is
    n vectorised compares over the history (numpy, no Python per token)."""
    if not is_int(max_ngram) or not is_int(min_ngram) or not 1 <= min_ngram <= max_ngram:
        raise ConfigError(f"prompt_lookup needs 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                          f"max_ngram={max_ngram!r}")

    def draft(tokens: Sequence[int], k: int) -> List[int]:
        if k <= 0:
            return []
        seq = _as_array(tokens)
        size = seq.shape[0]
        for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
            m = size - n  # earlier starts 0 .. m - 1; the tail n-gram starts at m
            hit = seq[:m] == seq[m]
            for j in range(1, n):
                hit &= seq[j:j + m] == seq[m + j]
            last = m - 1 - int(hit[::-1].argmax())  # the latest earlier occurrence, if hit there
            if hit[last]:
                return seq[last + n:last + n + k].tolist()
        return []

    return draft


def draft_ids(result: Any, k: int, vocab_size: int) -> List[int]:
    """A drafter's result as its first k token ids: an iterable of integers (list, tuple, numpy integers, a
    generator) or a 1-D integer array or tensor, by the prompt rule (`hwkv.engine.inputs.token_ids`); the first k
    inside [0, vocab_size). ConfigError naming what the drafter returned otherwise."""
    if result.__class__ is list and all(t.__class__ is int for t in result):  # the usual case (prompt_lookup's)
        ids = result[:k]
    else:
        try:
            ids = token_ids(result, "draft")[:k]
        except ConfigError as e:
            raise ConfigError(f"the drafter returned {shown(result)}: {e}") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"the drafter proposed token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    return ids
