"""hwkv: a hardware-portable hybrid (full + sliding-window) KV cache for LLM inference engines.

`hwkv.current_device` is resolved on first access and cached (cheap probes: no device context; the torch
extensions torch_npu and torch_musa are imported to be probed, where installed).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from hwkv.checks import normal_tensors as _normal_tensors
from hwkv.req_to_token import ReqToTokenPool
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc

if TYPE_CHECKING:  # the backend module loads on first use, not with `import hwkv`
    from hwkv.backend import AttentionBackend

__version__ = "0.1.0"
__all__ = ["ReqToTokenPool", "ForwardBatch", "ForwardMode", "AttentionLayer", "KVWriteLoc",
           "make_backend", "current_device"]


def __getattr__(name: str) -> Any:
    if name == "current_device":
        from hwkv.devices import current_device
        return current_device()
    raise AttributeError(f"module 'hwkv' has no attribute {name!r}")


@_normal_tensors   # a backend built under torch.inference_mode() still steps outside it
def make_backend(pool: Any, req_to_token_pool: Any, device: Union[None, str, Any] = None,
                 **options: Any) -> "AttentionBackend":
    """Build the attention backend of `device`: a plugin name, a DeviceSpec, a torch.device (the pool's: the plugin
    serving its type, as for None), or None (the current device, or where the pool lives elsewhere, e.g. a CPU pool
    on a GPU machine, the best available plugin for the pool's device). DeviceError for an unknown or unavailable
    device, one whose tensors are not the pool's, or any other kind of value."""
    import torch

    from hwkv import devices
    from hwkv.errors import DeviceError

    pool_device = getattr(pool, "device", "cpu")
    pool_type = str(pool_device).split(":")[0]
    if isinstance(device, torch.device):
        pool_index = str(pool_device).partition(":")[2]  # "" where the pool names no index
        other_index = device.index is not None and pool_index != "" and str(device.index) != pool_index
        if device.type != pool_type or other_index:
            raise DeviceError(f"device={device!r} is not the pool's device {pool_device}: build the pool on "
                              f"{str(device)!r} or pass device=None")
        device = None  # the pool's device: chosen as for None
    if device is None:
        spec = devices.current_device()
        if spec.torch_device != pool_type:  # e.g. a CPU pool on a GPU machine: the pool decides
            matching = [s for s in devices.discover().values() if s.torch_device == pool_type and s.is_available()]
            if not matching:
                raise DeviceError(f"no available device plugin serves pools on {pool_type!r}")
            spec = max(matching, key=lambda s: s.priority)
    elif isinstance(device, str):
        spec = devices.by_name(device)
    elif isinstance(device, devices.DeviceSpec):
        spec = device
    else:
        raise DeviceError(f"device={device!r} ({type(device).__name__}) is not a device: pass a device plugin name "
                          f"(one of {sorted(devices.discover())}), a DeviceSpec, a torch.device or None")
    reason = spec.unavailable_reason()
    if reason is not None:
        raise DeviceError(f"device {spec.name!r} is unavailable: {reason}")
    if spec.torch_device != pool_type:
        raise DeviceError(f"device {spec.name!r} runs on {spec.torch_device!r} tensors, the pool is on {pool_type!r}")
    return spec.load_backend_class()(pool, req_to_token_pool, **options)
