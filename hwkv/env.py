"""The one typed table of environment variables hwkv reads; docs are generated from it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: name, parser, default and what it does."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        return self.default if raw is None else self.parse(raw)


HWKV_DEVICE: EnvVar[str] = EnvVar("HWKV_DEVICE", str, "", "Force the device plugin by name (error if unavailable).")
HWKV_DEBUG: EnvVar[bool] = EnvVar(
    "HWKV_DEBUG", _flag, False,
    "Extra checks that cost host syncs on accelerators: loc range checks in the pool, "
    "an in-window token translating to SWA slot 0 raises EvictedSlotError, verify-tree and accept "
    "values are checked, and context-parallel saves agree across ranks on every layer's inputs.")

ALL = (HWKV_DEVICE, HWKV_DEBUG)


def markdown_table() -> str:
    """The table of variables as Markdown, for the README."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | `{v.default!r}` | {v.doc} |" for v in ALL]
    return "\n".join(rows)
