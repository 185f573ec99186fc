"""NPU graphs: torch.npu.NPUGraph, with the fused attention's host lengths updated before every replay.

Verified in Ascend/pytorch torch_npu/npu/graphs.py: `graph(npu_graph, pool=None, stream=None, ...)`
captures on the given stream, `NPUGraph.pool()` / `.replay()` mirror torch.cuda's.

The fused op takes its sequence lengths as host lists, which a captured graph would freeze. So each
fused call captured in a graph is its own task group (hwkv_npu.fia.graph_call), recorded here while the
adapter captures; before each replay `pre_replay` re-issues every recorded call between
graph_task_update_begin/end on a stream of its own with this forward's lengths, and records the
group's ExternalEvent, which the replay waits on (Ascend/op-plugin
docs/context/torch_npu-npu-graph_task_update_begin.md: the update stream must differ from the capture
stream). The update stream first waits for the work already queued, so it never rewrites a task the
previous replay is still running; no host sync.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from hwkv.errors import ConfigError
from hwkv.graph import TorchDeviceGraphAdapter
from hwkv_npu import import_torch_npu

_TASKS: contextvars.ContextVar[Optional[List["FIATask"]]] = contextvars.ContextVar("hwkv_npu_tasks", default=None)


@dataclass(frozen=True)
class FIATask:
    """A captured task group: its handle, the ExternalEvent the graph waits on, the call to re-issue."""

    handle: Any
    event: Any
    call: Any  # hwkv_npu.fia.FIACall


def record_task(handle: Any, event: Any, call: Any) -> None:
    """Called by a fused call captured in a task group; the capturing adapter keeps it for its updates."""
    tasks = _TASKS.get()
    if tasks is None:
        raise ConfigError("the fused attention was captured in an NPU graph outside NPUGraphAdapter: its host "
                          "lengths would never be updated (capture through hwkv_npu.graph.NPUGraphAdapter)")
    tasks.append(FIATask(handle, event, call))


@contextlib.contextmanager
def task_scope() -> Iterator[List[FIATask]]:
    """The task groups captured inside the block."""
    tasks: List[FIATask] = []
    token = _TASKS.set(tasks)
    try:
        yield tasks
    finally:
        _TASKS.reset(token)


def update_tasks(tasks: Sequence[FIATask], stream: Any) -> None:
    """Re-issue every captured fused call with this forward's lengths, then release its replay."""
    rt = torch.npu
    stream.wait_stream(rt.current_stream())  # after the previous replay: device order, no host sync
    with rt.stream(stream):
        for t in tasks:
            rt.graph_task_update_begin(stream, t.handle)
            t.call.issue()
            rt.graph_task_update_end(stream)
            t.event.record(stream)


class NPUTaskUpdates:
    """Graph-adapter mixin: capture inside a task scope; before each replay, update the recorded groups."""

    _update_stream: Any = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        with task_scope() as tasks:
            handle, out = super().capture(fn)  # type: ignore[misc]
        return (handle, tuple(tasks)), out

    def pre_replay(self, graph: Any) -> None:
        handle, tasks = graph
        if tasks:
            if self._update_stream is None:
                self._update_stream = torch.npu.Stream()
            update_tasks(tasks, self._update_stream)
        super().pre_replay(handle)  # type: ignore[misc]

    def replay(self, graph: Any) -> torch.Tensor:
        return super().replay(graph[0])  # type: ignore[misc]


class NPUGraphAdapter(NPUTaskUpdates, TorchDeviceGraphAdapter):
    """torch.npu.NPUGraph captured on a side stream, one memory pool across buckets; fused-attention
    task groups updated with each forward's host lengths before replay."""

    module = "npu"
    graph_class = "NPUGraph"

    def __init__(self) -> None:
        if getattr(torch, "npu", None) is None:
            try:
                import_torch_npu()  # registers torch.npu
            except ConfigError as e:
                raise ConfigError(f"{e}: NPU graphs (torch.npu.NPUGraph) are unavailable") from e
        npu = getattr(torch, "npu", None)
        if npu is None:
            raise ConfigError("torch_npu imported but did not register torch.npu: NPU graphs are unavailable")
        if not npu.is_available():
            raise ConfigError("torch.npu.is_available() is False: NPU graphs need a visible Ascend NPU")
        super().__init__()
