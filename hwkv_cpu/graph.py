"""CPU graph mode: torch.compile over the runner's static buffers (capture = compile, replay = call)."""
from __future__ import annotations

from typing import Any, Callable, Tuple

import torch


class CompileGraphAdapter:
    """Compiles the step once per bucket; every replay re-reads the static buffers the base class refilled.

    `backend` is a torch.compile backend name; "eager" traces with dynamo without code generation
    (fast to capture, used by the tests); "inductor" generates C++ code.
    """

    def __init__(self, backend: str = "eager") -> None:
        self.backend = backend

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        compiled = torch.compile(fn, backend=self.backend, dynamic=False)
        return compiled, compiled()

    def replay(self, graph: Any) -> torch.Tensor:
        return graph()

    def pre_replay(self, graph: Any) -> None:
        return None
