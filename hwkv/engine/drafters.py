"""Draft token proposers for the engine's speculative verify: any callable (tokens so far, k) -> up to k ids.

The engine verifies drafts with the target model in one forward and keeps the longest prefix greedy decoding
would have produced, so a drafter changes speed only, never the tokens. `prompt_lookup` is the model-free one
(draft tokens copied from an earlier occurrence of the sequence's last n-gram: repeats in the prompt, quoted
text, code); a draft model wraps its own generate in the same signature.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

from hwkv.errors import ConfigError

Drafter = Callable[[Sequence[int], int], Sequence[int]]


def prompt_lookup(max_ngram: int = 3, min_ngram: int = 1) -> Drafter:
    """A drafter that finds the sequence's last n tokens (n from max_ngram down to min_ngram) earlier in it and
    proposes the k tokens that followed their latest earlier occurrence; nothing when no n-gram recurs."""
    if not isinstance(max_ngram, int) or not isinstance(min_ngram, int) or not 1 <= min_ngram <= max_ngram:
        raise ConfigError(f"prompt_lookup needs 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                          f"max_ngram={max_ngram!r}")

    def draft(tokens: Sequence[int], k: int) -> List[int]:
        seq = list(tokens)
        for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # the latest earlier occurrence
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + k]
        return []

    return draft
