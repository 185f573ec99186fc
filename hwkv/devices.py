"""Device plugins: `DeviceSpec`, the `hwkv.devices` entry-point registry, detection, `current_device`.

A device package exports one `DeviceSpec` as `DEVICE`; importing it must stay cheap (no vendor
library, no device context). Backends and graph adapters are import strings, loaded only on use.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from hwkv.env import HWKV_DEVICE
from hwkv.errors import ConfigError, DeviceError, HwkvError

ENTRY_POINT_GROUP = "hwkv.devices"

# The in-tree plugins, as pyproject.toml declares them; used when the distribution is not
# installed (running from a source tree). tests/test_devices.py keeps the two in step.
IN_TREE: dict[str, str] = {
    "cpu": "hwkv_cpu:DEVICE",
    "cuda": "hwkv_cuda:DEVICE",
    "musa": "hwkv_cuda.musa:DEVICE",
    "rocm": "hwkv_rocm:DEVICE",
    "xpu": "hwkv_xpu:DEVICE",
    "npu": "hwkv_npu:DEVICE",
}


def import_string(target: str, what: str) -> Any:
    """Import `"module:attr"`; any failure is a `DeviceError` naming `what` and `target`."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise DeviceError(f"{what}: import string {target!r} is not of the form 'module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # re-raised with the import string; never swallowed
        raise DeviceError(f"{what}: importing module {module_name!r} of {target!r} failed: "
                          f"{type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise DeviceError(f"{what}: {target!r}: module {module_name!r} has no attribute {attr!r}") from e
    return obj


@dataclass(frozen=True)
class DeviceSpec:
    """A device plugin: a cheap availability probe plus import strings for its backend and graph adapter.

    `probe()` returns None when the device is usable, otherwise why not. It must not create a
    device context nor import a vendor library (except where importing is the only test).
    """

    name: str
    priority: int
    probe: Callable[[], Optional[str]]
    backend: str
    graph_adapter: str
    torch_device: str
    description: str
    # optional "module:function" returning a hwkv.paths.PathTable: which path each layer kind takes here
    # (imported only by `hwkv info`; empty: the device reports none)
    layer_paths: str = ""
    # optional "module:function" returning (path, why): the attention path this device takes on this machine
    # (imported only when asked, by `hwkv info`; empty: the device names its backend)
    attention_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"DeviceSpec.name must be a non-empty word, got {self.name!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ConfigError(f"DeviceSpec {self.name!r}: priority must be an int, got {self.priority!r}")
        if not callable(self.probe):
            raise ConfigError(f"DeviceSpec {self.name!r}: probe must be callable, got {self.probe!r}")
        for field, value, optional in (("backend", self.backend, False),
                                       ("graph_adapter", self.graph_adapter, True),
                                       ("layer_paths", self.layer_paths, True),
                                       ("attention_path", self.attention_path, True)):
            if not isinstance(value, str) or (not (optional and value == "") and value.count(":") != 1):
                raise ConfigError(f"DeviceSpec {self.name!r}: {field} must be 'module:attr'"
                                  f"{' or empty' if optional else ''}, got {value!r}")

    def unavailable_reason(self) -> Optional[str]:
        """None when the device is usable, otherwise the probe's reason. A probe that raises (e.g. a vendor
        extension that is installed but crashes on import) is never taken as "unavailable": it propagates as a
        DeviceError naming the device, chained to the probe's exception."""
        try:
            reason = self.probe()
        except HwkvError:
            raise
        except Exception as e:
            raise DeviceError(f"device {self.name!r}: its probe raised {type(e).__name__}: {e}; repair or uninstall "
                              f"what it probes, or set {HWKV_DEVICE.name} to another device (only the forced "
                              f"device is probed then)") from e
        if reason is not None and not (isinstance(reason, str) and reason):
            raise DeviceError(f"device {self.name!r}: probe must return None or a non-empty reason, "
                              f"got {reason!r}")
        return reason

    def is_available(self) -> bool:
        """True when the probe reports the device usable."""
        return self.unavailable_reason() is None

    def load_backend_class(self) -> type:
        """Import the backend class; a failure is a `DeviceError` naming the import string."""
        return import_string(self.backend, f"backend of device {self.name!r}")

    def load_layer_paths(self) -> Optional[Callable[[], Any]]:
        """The function answering which path each layer kind takes (None when the device reports none)."""
        if not self.layer_paths:
            return None
        return import_string(self.layer_paths, f"layer paths of device {self.name!r}")

    def describe_attention_path(self) -> tuple[str, str]:
        """(the attention path this device takes here, why), from the plugin's hook, imported only now; a spec
        without one (e.g. a third party's) answers with its backend, so setting the hook stays optional."""
        if not self.attention_path:
            return self.backend, f"the {self.name} plugin reports none (DeviceSpec.attention_path is empty)"
        answer = import_string(self.attention_path, f"attention path of device {self.name!r}")()
        if not (isinstance(answer, tuple) and len(answer) == 2 and all(isinstance(a, str) and a for a in answer)):
            raise DeviceError(f"device {self.name!r}: {self.attention_path} must return (path, why), two non-empty "
                              f"strings, got {answer!r}")
        return answer

    def describe_layer_paths(self) -> Any:
        """The plugin's per-kind layer-path table (`hwkv.paths.PathTable`), from its hook imported only now; a hook that
        raises or answers anything else is a DeviceError naming it."""
        from hwkv.paths import PathTable
        fn = self.load_layer_paths()
        if fn is None:
            raise DeviceError(f"device {self.name!r} reports no layer-path table (DeviceSpec.layer_paths is empty)")
        try:
            table = fn()
        except DeviceError:
            raise
        except Exception as e:  # noqa: BLE001 - a plugin's hook: reported, named
            raise DeviceError(f"device {self.name!r}: {self.layer_paths} raised {type(e).__name__}: {e}") from None
        if not isinstance(table, PathTable):
            raise DeviceError(f"device {self.name!r}: {self.layer_paths} must return a hwkv.paths.PathTable, got "
                              f"{type(table).__name__}")
        return table

    def load_graph_adapter(self) -> Optional[type]:
        """Import the graph adapter class, or None when the device has none."""
        if not self.graph_adapter:
            return None
        return import_string(self.graph_adapter, f"graph adapter of device {self.name!r}")


def probe_torch_extension(module: str, torch_attr: str) -> Optional[str]:
    """Probe for devices shipped as a torch extension (torch_npu, torch_musa): installed, imports, sees a device.

    Importing `module` is the only way to know, so it happens here; only ImportError becomes the reason (any
    other exception propagates, as a DeviceError from `DeviceSpec.unavailable_reason`).
    """
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{module} is installed but does not import: {e}"
    import torch

    api = getattr(torch, torch_attr, None)
    if api is None:
        return f"{module} imported but did not register torch.{torch_attr}"
    if not api.is_available():
        return f"torch.{torch_attr}.is_available() is False (no device visible)"
    return None


_REGISTERED: dict[str, DeviceSpec] = {}


def register(spec: DeviceSpec, *, replace: bool = False) -> None:
    """Register a spec programmatically; it takes precedence over entry points of the same name."""
    if not isinstance(spec, DeviceSpec):
        raise DeviceError(f"register() takes a DeviceSpec, got {type(spec).__name__}")
    old = _REGISTERED.get(spec.name)
    if old is not None and old is not spec and not replace:
        raise DeviceError(f"device {spec.name!r} is already registered ({old.description!r}); "
                          f"pass replace=True to replace it")
    _REGISTERED[spec.name] = spec
    current_device.cache_clear()


def unregister(name: str) -> None:
    """Remove a programmatically registered spec (KeyError names it when absent)."""
    del _REGISTERED[name]
    current_device.cache_clear()


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _checked(obj: Any, name: str, origin: str) -> DeviceSpec:
    if not isinstance(obj, DeviceSpec):
        raise DeviceError(f"device plugin {name!r} ({origin}) is a {type(obj).__name__}, not a DeviceSpec")
    if obj.name != name:
        raise DeviceError(f"device plugin {name!r} ({origin}) names itself {obj.name!r}; "
                          f"the entry-point name and DeviceSpec.name must agree")
    return obj


def discover(only: Optional[str] = None) -> dict[str, DeviceSpec]:
    """Every known device: entry points of `hwkv.devices`, in-tree specs not installed, registered specs. `only`:
    that device's alone (a device named or forced: no other plugin is loaded, so one that fails to import cannot
    keep it from being used)."""
    specs: dict[str, DeviceSpec] = {}
    seen: dict[str, tuple[str, str]] = {}  # name -> (entry-point value, origin)
    for ep in _entry_points():
        if only is not None and ep.name != only:
            continue
        dist = getattr(ep, "dist", None)
        origin = f"{ep.value!r} from {dist.name if dist is not None else 'an unknown distribution'}"
        if ep.name in seen:
            if ep.value == seen[ep.name][0]:
                continue  # the same plugin seen twice on sys.path
            raise DeviceError(f"two plugins claim device {ep.name!r}: {seen[ep.name][1]} and {origin}")
        try:
            obj = ep.load()
        except Exception as e:  # re-raised naming the entry point; never swallowed
            raise DeviceError(f"device plugin entry point {ep.name!r} = {origin} failed to load: "
                              f"{type(e).__name__}: {e}") from e
        specs[ep.name] = _checked(obj, ep.name, origin)
        seen[ep.name] = (ep.value, origin)
    for name, target in IN_TREE.items():
        if name not in specs and only in (None, name):
            specs[name] = _checked(import_string(target, f"in-tree device {name!r}"), name, repr(target))
    specs.update((n, s) for n, s in _REGISTERED.items() if only in (None, n))
    return specs


def by_name(name: str) -> DeviceSpec:
    """The device plugin called `name`, loading only its own (another plugin that fails to import cannot keep it from
    being used); DeviceError naming the known ones where there is none (available or not: callers ask)."""
    spec = discover(only=name).get(name)
    if spec is None:
        raise DeviceError(f"unknown device {name!r}; known devices: {', '.join(sorted(discover()))}")
    return spec


def named(name: str) -> DeviceSpec:
    """The device `name`, loading only its own plugin where it is known and available; otherwise what `select`
    says of it over every device (unknown, or unavailable, with the known and available ones named)."""
    spec = discover(only=name).get(name)
    if spec is not None and spec.unavailable_reason() is None:
        return spec
    return select(discover(), name)


def report(specs: dict[str, DeviceSpec], show_probe_errors: bool = False) -> list[tuple[DeviceSpec, Optional[str]]]:
    """Each spec with its unavailability reason (None = available), highest priority first. A probe that raises
    raises its DeviceError here too, unless `show_probe_errors` (a table for people, `hwkv info`): then the
    error's text is that device's reason, and the other devices are still listed."""
    ordered = sorted(specs.values(), key=lambda s: (-s.priority, s.name))
    return [(spec, _reason(spec, show_probe_errors)) for spec in ordered]


def _reason(spec: DeviceSpec, show_probe_errors: bool) -> Optional[str]:
    try:
        return spec.unavailable_reason()
    except DeviceError as e:
        if not show_probe_errors:
            raise
        return str(e)


def _available_names(specs: dict[str, DeviceSpec]) -> str:
    names = [s.name for s, reason in report(specs, show_probe_errors=True) if reason is None]
    return ", ".join(names) if names else "none"


def select(specs: dict[str, DeviceSpec], forced: Optional[str] = None) -> DeviceSpec:
    """The forced device (error if unknown or unavailable), else the highest-priority available one."""
    if forced:
        spec = specs.get(forced)
        if spec is None:
            raise DeviceError(f"{HWKV_DEVICE.name}={forced!r} names no known device "
                              f"(known: {', '.join(sorted(specs))}); available: {_available_names(specs)}")
        reason = spec.unavailable_reason()
        if reason is not None:
            raise DeviceError(f"{HWKV_DEVICE.name}={forced!r} but device {forced!r} is unavailable: "
                              f"{reason}; available: {_available_names(specs)}")
        return spec
    available = [spec for spec, reason in report(specs) if reason is None]
    if not available:
        raise DeviceError(f"no device is available (known: {', '.join(sorted(specs)) or 'none'}); "
                          f"the in-tree 'cpu' device should always be")
    top = [s for s in available if s.priority == available[0].priority]
    if len(top) > 1:
        names = " and ".join(repr(s.name) for s in top)
        raise DeviceError(f"devices {names} are both available with priority {top[0].priority}; "
                          f"set {HWKV_DEVICE.name} to one of them")
    return top[0]


def resolve_current_device() -> DeviceSpec:
    """Discover and select now (uncached), honouring `HWKV_DEVICE` (a forced device loads only its own plugin)."""
    forced = HWKV_DEVICE.get().strip() or None
    return named(forced) if forced else select(discover())


@functools.lru_cache(maxsize=1)
def current_device() -> DeviceSpec:
    """The device hwkv uses: `resolve_current_device()`, cached (`register()` clears the cache)."""
    return resolve_current_device()
