"""Which hwkv device plugin serves the model, and which graph adapter its decode forwards replay through."""
from __future__ import annotations

from typing import Any, Optional, Union

from hwkv import devices
from hwkv.devices import DeviceSpec
from hwkv.errors import ConfigError, DeviceError

GRAPH_CHOICES = ("auto", "on", "off", "eager")


def available_spec(name: Optional[str]) -> DeviceSpec:
    """The plugin called `name` (default: the detected one), present here: DeviceError when the name is
    unknown (listing the known ones) or the device is unavailable (with its probe's reason). `hwkv bench`,
    `verify` and `generate` all pick their device through this."""
    if name is None:
        return devices.current_device()
    spec = devices.by_name(name)
    reason = spec.unavailable_reason()
    if reason is not None:
        raise DeviceError(f"device {spec.name!r} is unavailable: {reason}")
    return spec


def resolve_spec(name: Optional[str], torch_device: str) -> DeviceSpec:
    """The plugin called `name`, or the detected one when it serves `torch_device` tensors, else the
    highest-priority available plugin that does; it must run on the model's device type."""
    if name is not None:
        spec = devices.by_name(name)
    else:
        spec = devices.current_device()
        if spec.torch_device != torch_device:
            matching = [s for s in devices.discover().values() if s.torch_device == torch_device and s.is_available()]
            if not matching:
                raise DeviceError(f"no available device plugin runs on {torch_device!r} tensors")
            spec = max(matching, key=lambda s: s.priority)
    if spec.torch_device != torch_device:
        raise DeviceError(f"device {spec.name!r} runs on {spec.torch_device!r} tensors, "
                          f"the model is on {torch_device!r}")
    reason = spec.unavailable_reason()
    if reason is not None:
        raise DeviceError(f"device {spec.name!r} is unavailable: {reason}")
    return spec


def graph_choice(graphs: Union[bool, str]) -> str:
    """The `graphs=` option as one of GRAPH_CHOICES (True is "on", False "off")."""
    choice = ("on" if graphs else "off") if isinstance(graphs, bool) else graphs
    if choice not in GRAPH_CHOICES:
        raise ConfigError(f"graphs={graphs!r}; choose one of {', '.join(GRAPH_CHOICES)} (or True/False)")
    return choice


def graph_adapter(spec: DeviceSpec, graphs: Union[bool, str]) -> Any:
    """The adapter decode replays through, or None for eager decode.

    "auto": the device's graphs (CUDA/HIP/XPU/NPU graphs), none on the CPU, whose adapter compiles the
    whole model with torch.compile at start-up ("on" asks for it); "on"/True: the device's adapter (an
    error where it has none); "eager": hwkv's static buffers replayed by calling the step (no device
    graph: what the graph path does, on any device); "off"/False: eager forwards.
    """
    choice = graph_choice(graphs)
    if choice == "off" or (choice == "auto" and spec.torch_device == "cpu"):
        return None
    if choice == "eager":
        from hwkv.graph import EagerAdapter

        return EagerAdapter()
    cls = spec.load_graph_adapter()
    if cls is None:
        if choice == "auto":
            return None
        raise ConfigError(f"device {spec.name!r} has no graph adapter: use graphs='eager' or 'off'")
    return cls()
