"""The one typed table of environment variables hwkv reads; docs are generated from it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from hwkv.errors import ConfigError

T = TypeVar("T")


TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("", "0", "false", "no", "off")


def _flag(raw: str) -> bool:
    """A boolean flag: one of TRUE_VALUES or FALSE_VALUES (any case, surrounding blanks ignored); anything
    else is a ValueError, which `EnvVar.get` turns into a ConfigError naming the variable."""
    value = raw.strip().lower()
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise ValueError(f"allowed: {'/'.join(TRUE_VALUES)} (on), {'/'.join(v for v in FALSE_VALUES if v)} or empty "
                     "(off), any case")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: name, parser, default and what it does."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        """The parsed value (the default when unset); ConfigError names the variable, its value and the
        allowed values when the value does not parse."""
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ConfigError(f"{self.name}={raw!r} is not a valid value; {e}") from None


HWKV_DEVICE: EnvVar[str] = EnvVar("HWKV_DEVICE", str, "", "Force the device plugin by name (error if unavailable).")
HWKV_DEBUG: EnvVar[bool] = EnvVar(
    "HWKV_DEBUG", _flag, False,
    "Extra checks that cost host syncs on accelerators: loc range checks in the pool, "
    "an in-window token translating to SWA slot 0 raises EvictedSlotError, verify-tree and accept "
    "values are checked, and context-parallel saves agree across ranks on every layer's inputs.")

HWKV_HOPPER_EXTEND: EnvVar[bool] = EnvVar(
    "HWKV_HOPPER_EXTEND", _flag, True,
    "On Hopper (sm_90) GPUs, prefill/extend attention of at least 1024 query tokens (window layers: 4096 at head "
    "dim 64, 2048 at 128) takes the warp-specialised Gluon kernel where it applies (bf16/fp16, head dim 64 or 128); "
    "0 keeps the portable Triton kernel everywhere.")

ALL = (HWKV_DEVICE, HWKV_DEBUG, HWKV_HOPPER_EXTEND)


def markdown_table() -> str:
    """The table of variables as Markdown, for the README."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | `{v.default!r}` | {v.doc} |" for v in ALL]
    return "\n".join(rows)
