"""CPU graph mode: torch.compile over the runner's static buffers (capture = compile, replay = call)."""
from __future__ import annotations

import itertools
import types
from typing import Any, Callable, Tuple

import torch

_captures = itertools.count()


class CompileGraphAdapter:
    """Compiles the step once per bucket; every replay re-reads the static buffers the base class refilled.

    `backend` is a torch.compile backend name; "eager" traces with dynamo without code generation
    (fast to capture, used by the tests); "inductor" generates C++ code. Each capture compiles a function with a
    code object of its own: dynamo keeps its compiled entries on the code object, so buckets captured through one
    shared function would be recompiles of each other (the eighth one falls back to eager) and every call would
    test the other buckets' guards first.
    """

    def __init__(self, backend: str = "eager") -> None:
        self.backend = backend

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        compiled = torch.compile(_own_code(fn), backend=self.backend, dynamic=False)
        return compiled, compiled()

    def replay(self, graph: Any) -> torch.Tensor:
        return graph()

    def pre_replay(self, graph: Any) -> None:
        return None


def _own_code(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`fn` called through a function whose code object no other capture shares (named hwkv_graph_<n>)."""
    def call() -> torch.Tensor:
        return fn()

    code = call.__code__.replace(co_name=f"hwkv_graph_{next(_captures)}")
    return types.FunctionType(code, call.__globals__, code.co_name, call.__defaults__, call.__closure__)
