"""Percentiles of measured times, one definition for every `hwkv bench` table.

`percentile(xs, q)` interpolates linearly between the closest ranks: for the sorted values x_0..x_{n-1} it is
x_j + f (x_{j+1} - x_j) at position (n - 1) q = j + f. That is numpy's default, statistics.quantiles(...,
method="inclusive") and Hyndman & Fan's type 7: q = 0.5 is the median (the mean of the middle two of an even
count), q = 0 the least value, q = 1 the largest.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from hwkv.errors import ConfigError


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (q in [0, 1]) of `xs` by linear interpolation between the closest ranks (see module doc)."""
    if not 0 <= q <= 1:
        raise ConfigError(f"percentile: q must be in [0, 1], got {q!r}")
    if not xs:
        raise ConfigError("percentile: no values")
    s = sorted(xs)
    h = (len(s) - 1) * q
    j = math.floor(h)
    f = h - j
    if f == 0 or s[j] == s[j + 1]:
        return s[j]
    return min(max(s[j] + f * (s[j + 1] - s[j]), s[j]), s[j + 1])   # the doc's form, kept between its two values


@dataclass
class Spread:
    """Milliseconds over the timed steps: median, 10th and 90th percentiles (`percentile`), mean."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> "Spread":
        ms = [t * 1e3 for t in seconds]
        return cls(percentile(ms, 0.5), percentile(ms, 0.1), percentile(ms, 0.9), statistics.fmean(ms))
