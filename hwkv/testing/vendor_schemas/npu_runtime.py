"""The NPU graph task-group runtime stand-in: the part of `torch.npu` (after `import torch_npu`) that hwkv uses.

It keeps the contract of Ascend/op-plugin docs/context/torch_npu-npu-graph_task_group_begin.md,
..._group_end.md, ..._update_begin.md and ..._update_end.md: task groups open and close on the capturing
stream, one op each; an update names a captured group's handle, runs on a stream other than the capture
stream and re-issues the same op on the same tensors; a group whose ExternalEvent the graph waits on must
be recorded (updated) before every replay, or the device graph would wait forever. Inside
`NPUGraph.replaying()` (a replay simulated by re-running the step) a fused call computes with its task
group's current host arguments, whatever the re-run passes, as a device graph would.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from hwkv.testing.vendor_schemas.core import VendorCallError, require


# ---- the graph task-group runtime (torch.npu after `import torch_npu`) -----------------------------
@dataclass
class _Stream:
    sid: int

    def wait_stream(self, other: "_Stream") -> None:
        return None

    def synchronize(self) -> None:
        return None


@dataclass
class _Event:
    records: int = 0
    waited: bool = False

    def wait(self, stream: _Stream) -> None:
        self.waited = True

    def reset(self, stream: _Stream) -> None:
        return None

    def record(self, stream: Optional[_Stream] = None) -> None:
        self.records += 1


@dataclass
class _TaskGroup:
    """One captured task group: the op issued inside it, its arguments as captured or last updated."""

    stream: _Stream
    events: List[_Event]
    op: Optional[str] = None
    params: Optional[Dict[str, Any]] = None
    updates: int = 0
    records_at_replay: int = 0


@dataclass
class _Graph:
    runtime: "FakeNPURuntime"
    groups: List[_TaskGroup] = field(default_factory=list)
    replays: int = 0

    def pool(self) -> Tuple[str, int]:
        return ("fake-npu-pool", id(self))

    def _check_updated(self) -> None:
        for i, grp in enumerate(self.groups):
            pending = [e for e in grp.events if e.waited]
            if any(e.records <= grp.records_at_replay for e in pending):
                raise VendorCallError(f"replay of an NPU graph whose task group {i} was not updated since the last "
                                      "replay: its ExternalEvent was never recorded, the graph would wait forever")
            grp.records_at_replay = max((e.records for e in pending), default=0)

    def replay(self) -> None:
        self._check_updated()
        self.replays += 1

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """A replay simulated by re-running the step: each fused call takes its group's current arguments."""
        self._check_updated()
        self.replays += 1
        rt = self.runtime
        rt.replay_queue = list(self.groups)
        try:
            yield
            require(not rt.replay_queue, "NPUGraph.replay", f"{len(rt.replay_queue)} captured task group(s) were "
                    "not reached: the step issued fewer fused calls than it captured")
        finally:
            rt.replay_queue = None


class FakeNPURuntime:
    """The part of `torch.npu` hwkv uses: graphs, streams, external events, task groups and updates."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.default = _Stream(0)
        self._current = self.default
        self.capturing: Optional[_Graph] = None
        self.capture_stream: Optional[_Stream] = None
        self.open_group: Optional[_TaskGroup] = None
        self.updating: Optional[Tuple[_TaskGroup, _Stream]] = None
        self.replay_queue: Optional[List[_TaskGroup]] = None
        self._pending_events: List[_Event] = []
        self._update_issued = False
        self.NPUGraph = lambda: _Graph(self)
        self.ExternalEvent = self._event

    # streams and graphs
    def Stream(self) -> _Stream:  # noqa: N802 - torch's name
        return _Stream(next(self._ids))

    def current_stream(self) -> _Stream:
        return self._current

    @contextlib.contextmanager
    def stream(self, s: _Stream) -> Iterator[None]:
        before, self._current = self._current, s
        try:
            yield
        finally:
            self._current = before

    @contextlib.contextmanager
    def graph(self, g: _Graph, pool: Any = None, stream: Optional[_Stream] = None) -> Iterator[None]:
        require(self.capturing is None, "torch.npu.graph", "nested capture")
        s = stream or self.Stream()
        self.capturing, self.capture_stream = g, s
        try:
            with self.stream(s):
                yield
        finally:
            self.capturing, self.capture_stream = None, None
            require(self.open_group is None, "torch.npu.graph", "a task group was left open at the end of capture")

    def is_available(self) -> bool:
        return True

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None and self._current is self.capture_stream

    def synchronize(self) -> None:
        return None

    def _event(self) -> _Event:
        e = _Event()
        if self.capturing is not None:
            self._pending_events.append(e)
        return e

    # task groups
    def graph_task_group_begin(self, stream: _Stream) -> None:
        op = "torch.npu.graph_task_group_begin"
        require(self.capturing is not None and stream is self.capture_stream, op, "only on the capturing stream")
        require(self.open_group is None, op, "task groups do not nest")
        self.open_group = _TaskGroup(stream, [e for e in self._pending_events if e.waited])
        self._pending_events = []

    def graph_task_group_end(self, stream: _Stream) -> _TaskGroup:
        op = "torch.npu.graph_task_group_end"
        grp = self.open_group
        require(grp is not None and stream is grp.stream, op, "no task group open on this stream")
        require(grp.op is not None, op, "an empty task group")
        self.capturing.groups.append(grp)
        self.open_group = None
        return grp

    def graph_task_update_begin(self, stream: _Stream, handle: _TaskGroup) -> None:
        op = "torch.npu.graph_task_update_begin"
        require(isinstance(handle, _TaskGroup) and handle.params is not None, op, "not a handle of a captured task group")
        require(stream is not handle.stream, op, "the update stream must differ from the capture stream")
        require(self.updating is None, op, "updates do not nest")
        self.updating = (handle, stream)
        self._update_issued = False

    def graph_task_update_end(self, stream: _Stream) -> None:
        op = "torch.npu.graph_task_update_end"
        require(self.updating is not None and self.updating[1] is stream, op, "no update open on this stream")
        require(self._update_issued, op, "an update that re-issued no op")
        self.updating = None

    # the fused op's side of it
    def issue(self, op: str, params: Dict[str, Any], compute) -> None:
        """Run one fused `.out` call as the runtime state dictates (capture, update, replay or eager)."""
        if self.updating is not None:
            grp = self.updating[0]
            _same_tensors(op, grp, params)
            grp.params, grp.updates = dict(params), grp.updates + 1
            self._update_issued = True
            return
        if self.replay_queue is not None and not self.is_current_stream_capturing():
            # a replay re-run: tensors made inside the step are new objects (a device graph reuses the
            # captured memory; the capture-checking adapter checks the rest), host arguments are the group's
            require(bool(self.replay_queue), op, "more fused calls than the graph captured")
            grp = self.replay_queue.pop(0)
            _same_layout(op, grp, params)
            params = {k: (v if _is_tensors(v) else grp.params[k]) for k, v in params.items()}
        elif self.capturing is not None and self.open_group is not None:
            require(self.open_group.op is None, op, "one op per task group")
            self.open_group.op, self.open_group.params = op, dict(params)
        compute(params)


def _is_tensors(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and bool(v) and isinstance(v[0], torch.Tensor))


def _same_layout(op: str, grp: _TaskGroup, params: Dict[str, Any]) -> None:
    require(grp.op == op, op, f"the task group captured {grp.op}")
    for name, old in grp.params.items():
        new = params.get(name)
        olds, news = ([old], [new]) if isinstance(old, torch.Tensor) else (old, new)
        if _is_tensors(old):
            require(_is_tensors(new) and len(olds) == len(news) and all(
                a.shape == b.shape and a.dtype == b.dtype for a, b in zip(olds, news)), op,
                f"{name} differs in shape or dtype from what the task group captured")


def _same_tensors(op: str, grp: _TaskGroup, params: Dict[str, Any]) -> None:
    require(grp.op == op, op, f"the task group captured {grp.op}")
    for name, old in grp.params.items():
        new = params.get(name)
        if isinstance(old, torch.Tensor):
            require(isinstance(new, torch.Tensor) and new.data_ptr() == old.data_ptr() and new.shape == old.shape,
                    op, f"{name} is not the tensor the task group captured (a graph reads the memory it captured)")
        elif isinstance(old, (list, tuple)) and old and isinstance(old[0], torch.Tensor):
            require(all(a.data_ptr() == b.data_ptr() for a, b in zip(old, new)), op, f"{name}: not the output tensors the task group captured")
