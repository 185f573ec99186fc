"""A graph adapter for CPU tests that catches what a real device graph would get wrong silently.

A captured graph replays kernels on the exact memory it saw at capture. A backend that moves its
metadata (reallocates a static buffer, builds a fresh list per replay) still works when the step's
Python re-runs, as under `EagerAdapter`, but a real graph then reads stale or freed memory.
`CaptureCheckingAdapter` re-runs the step like `EagerAdapter` and records the storages every torch op
and every Triton launch reads that the step did not create itself; a replay that reads a storage
the capture did not see raises `StaleCaptureError`. So does a replay whose Triton launches differ from the
capture's in a value a graph freezes: the kernels launched, their grids and their scalar arguments (a host
number passed as an argument stays the capture's in every replay; what changes per step must be read from
device memory the host writes). `CaptureChecked` puts the same check around another
adapter whose replay runs the step's Python; the contract suite's graph tests run every target's adapter through
`capture_checked`, so a backend passes them only when its replays read what its captures read.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hwkv.errors import HwkvError


class StaleCaptureError(HwkvError, AssertionError):
    """A replay read memory its capture did not: a real device graph would read stale buffers."""


def _storages(values: Iterable[Any]) -> Iterable[Tuple[int, torch.Tensor]]:
    for v in values:
        if isinstance(v, torch.Tensor) and v.device.type != "meta" and v.untyped_storage().nbytes():
            yield v.untyped_storage().data_ptr(), v
        elif isinstance(v, (list, tuple)):
            yield from _storages(v)


class _Recorder(TorchDispatchMode):
    """Storages read by ops (and Triton launches) that were not created during the recording."""

    def __init__(self) -> None:
        super().__init__()
        self.created: Set[int] = set()
        self.read: Dict[int, str] = {}
        self.launches: List[Tuple[str, Tuple[Any, ...]]] = []  # (kernel, its scalar arguments), in launch order

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """A torch.compile'd step stays compiled under the recorder (which sees its compiled graph's ops as they
        run); without this, torch.compile runs the step eagerly while any dispatch mode is active. (A torch
        whose TorchDispatchMode lacks the hook runs it eagerly: the check holds, the compiled path is not run.)"""
        return True

    def note_reads(self, what: str, args: Iterable[Any]) -> None:
        for ptr, t in _storages(args):
            if ptr not in self.created:
                self.read.setdefault(ptr, f"{what} {tuple(t.shape)} {t.dtype}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            for ptr, _ in _storages(args):  # torch.tensor(...) inside the step: a constant made there
                self.created.add(ptr)
        self.note_reads(str(func), list(args) + list(kwargs.values()))
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else [out]
        for ptr, _ in _storages(outs):
            if not any(ptr == p for p, _ in _storages(list(args) + list(kwargs.values()))):
                self.created.add(ptr)  # a fresh result (a view of an input keeps the input's storage)
        return out


def _triton_classes() -> list:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


def _scalars(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    """A launch's values a graph freezes besides its buffers: every non-tensor argument (by position or name; the
    grid included), a tensor's place taken as its kind only (its storage is `_Recorder.read`'s check)."""
    def frozen(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return "tensor"
        if isinstance(v, (list, tuple)):
            return tuple(frozen(x) for x in v)
        return v if isinstance(v, (int, float, bool, str, type(None))) else type(v).__name__
    return tuple(frozen(a) for a in args) + tuple((k, frozen(v)) for k, v in sorted(kwargs.items())
                                                   if k != "warmup")


class _Recording(NamedTuple):
    read: Dict[int, str]
    launches: List[Tuple[str, Tuple[Any, ...]]]


def _recorded(fn: Callable[[], torch.Tensor]) -> Tuple[torch.Tensor, "_Recording"]:
    """Run fn once, returning its output, the external storages it read (torch ops + Triton launches) and its
    Triton launches' frozen values."""
    rec = _Recorder()
    patched = []
    for cls in _triton_classes():
        original = getattr(cls, "run", None)
        if original is None:  # e.g. Triton 3.4's InterpretedFunction launches through another method
            continue

        def run(self, *args, __orig=original, **kwargs):  # noqa: ANN001
            name = getattr(self, '__name__', 'kernel')
            rec.note_reads(f"triton {name}", list(args) + list(kwargs.values()))
            rec.launches.append((name, _scalars(args, kwargs)))
            return __orig(self, *args, **kwargs)

        cls.run = run
        patched.append((cls, original))
    try:
        with rec:
            out = fn()
    finally:
        for cls, original in patched:
            cls.run = original
    return out, _Recording(rec.read, rec.launches)


class CaptureCheckingAdapter:
    """EagerAdapter plus a check that every replay reads only the storages its capture read."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        out, reads = _recorded(fn)
        return (fn, reads), out

    def replay(self, graph: Any) -> torch.Tensor:
        fn, captured = graph
        out, reads = _recorded(fn)
        _check(reads, captured)
        return out

    def pre_replay(self, graph: Any) -> None:
        return None


def _check(replay: "_Recording", captured: "_Recording") -> None:
    stale = {p: what for p, what in replay.read.items() if p not in captured.read}
    if stale:
        first = next(iter(stale.values()))
        raise StaleCaptureError(f"a replay read {len(stale)} buffer(s) its capture did not (first: {first}); "
                                "a device graph would read the memory it captured: metadata must stay in "
                                "the static buffers allocated by init_graph_state")
    if replay.launches != captured.launches:
        names = [n for n, _ in captured.launches], [n for n, _ in replay.launches]
        if names[0] != names[1]:
            raise StaleCaptureError(f"a replay launched Triton kernels {names[1]} where its capture launched "
                                    f"{names[0]}: a device graph replays the captured launches")
        name, was, now = next((n, a, b) for (n, a), (_, b) in zip(captured.launches, replay.launches) if a != b)
        at = next((i for i, (x, y) in enumerate(zip(was, now)) if x != y), None)
        if at is None:
            raise StaleCaptureError(f"a replay launched {name} with {len(now)} arguments where its capture passed "
                                    f"{len(was)}: a device graph replays the captured launches")
        raise StaleCaptureError(f"a replay launched {name} with argument {at} = {now[at]!r} where its capture passed "
                                f"{was[at]!r}: a device graph replays the capture's value; a value that changes per "
                                "step must be read from device memory")


class CaptureChecked:
    """Another adapter whose replay runs the step's Python (EagerAdapter, a torch.compile adapter), with the
    capture check around its capture and every replay: `StaleCaptureError` when a replay reads a storage its
    capture did not. Its replay stays the inner adapter's (a compiled step still runs compiled)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        (graph, out), reads = _recorded(lambda: self.inner.capture(fn))
        return (graph, reads), out

    def replay(self, graph: Any) -> torch.Tensor:
        inner, captured = graph
        out, reads = _recorded(lambda: self.inner.replay(inner))
        _check(reads, captured)
        return out

    def pre_replay(self, graph: Any) -> None:
        self.inner.pre_replay(graph[0])


def capture_checked(adapter: Any) -> Any:
    """`adapter` with the capture check applied, for the contract suite's graph tests. A device graph (an adapter
    whose `records_device_work` is true: CUDA, HIP, MUSA, XPU, NPU graphs) is returned as it is: its replay runs
    no Python to check, it replays the memory it captured, so moved metadata shows there as outputs that differ
    from the reference. An adapter that already checks is returned as it is too; any other (its replay runs the
    step's Python, where moved metadata would go unnoticed) is wrapped in `CaptureChecked`."""
    if getattr(adapter, "records_device_work", False) or isinstance(adapter, (CaptureCheckingAdapter,
                                                                             CaptureChecked)):
        return adapter
    return CaptureChecked(adapter)
