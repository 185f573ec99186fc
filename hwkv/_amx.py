"""CPU feature probe for `hwkv info` and the CPU backend: AMX tiles, torch's CPU capability, sgl-kernel.

Reads /proc/cpuinfo and asks importlib where sgl_kernel is; imports no vendor module.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CPUFeatures:
    """What the CPU offers hwkv: `amx` needs amx_tile and amx_bf16; `reason` says how that was decided."""

    amx: bool
    reason: str
    amx_flags: tuple[str, ...]  # the AMX_FLAGS present, in AMX_FLAGS order
    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    sgl_kernel: bool  # importlib.util.find_spec("sgl_kernel") found it; it was not imported


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[set[str], str]:
    """The first `flags` line of /proc/cpuinfo as a set, and a note when it cannot be had."""
    if not sys.platform.startswith("linux"):
        return set(), f"{sys.platform}: /proc/cpuinfo is Linux-only"
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "flags":
                    return set(value.split()), ""
    except OSError as e:
        return set(), f"cannot read {cpuinfo}: {e}"
    return set(), f"{cpuinfo} has no 'flags' line (not x86)"


def cpu_capability() -> str:
    """torch's CPU kernel capability (DEFAULT, AVX2, AVX512, ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> CPUFeatures:
    """Probe AMX, torch's CPU capability and whether sgl_kernel is installed (never imported)."""
    flags, note = read_cpu_flags(cpuinfo)
    present = tuple(f for f in AMX_FLAGS if f in flags)
    amx = "amx_tile" in present and "amx_bf16" in present
    if note:
        reason = note
    elif amx:
        reason = f"{cpuinfo} flags: {' '.join(present)}"
    elif present:
        reason = f"{cpuinfo} flags have {' '.join(present)} but not both amx_tile and amx_bf16"
    else:
        reason = f"no amx_* flags in {cpuinfo}"
    return CPUFeatures(amx=amx, reason=reason, amx_flags=present, capability=cpu_capability(),
                       sgl_kernel=importlib.util.find_spec("sgl_kernel") is not None)
