"""The one window definition: a query at position i sees keys j with i - W < j <= i."""
from __future__ import annotations

from typing import Optional


def first_visible(pos: int, window: Optional[int]) -> int:
    """Smallest key position a query at `pos` may see (W keys, itself included)."""
    if window is None or window <= 0:
        return 0
    return max(0, pos - window + 1)


def window_left(window: Optional[int]) -> int:
    """FlashInfer/FA `window_left` (keys strictly left of the query) for HF `sliding_window`; -1 = none."""
    if window is None or window <= 0:
        return -1
    return window - 1


def no_window(window: Optional[int]) -> bool:
    return window is None or window <= 0
