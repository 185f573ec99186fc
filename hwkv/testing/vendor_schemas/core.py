"""Op schemas as data, and the stand-in op that binds a call against one before it computes.

A schema lists the op's arguments as the vendor declares them (name, kind, default, keyword-only),
so a call with a misspelled or missing argument, a positional argument where the vendor takes only
keywords, or a value of the wrong kind fails here, in CPU CI, with `VendorCallError`. Each stand-in
then checks the constraints the vendor documents or asserts (dtypes, layouts, shape relations) and
computes the op's documented result in plain torch.

A stand-in looks like the real callable to the code that inspects it: `inspect.signature` works
(AITER's Python functions) and `.default._schema.arguments` / `._schema.arguments` list the names
(torch ops: torch_npu's and sgl-kernel's).
"""
from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hwkv.errors import HwkvError

REQUIRED = inspect.Parameter.empty


class VendorCallError(HwkvError, AssertionError):
    """A call the vendor op would reject (wrong argument name, kind, dtype, layout or constraint)."""


@dataclass(frozen=True)
class Arg:
    """One argument: `kind` is Tensor, Tensor?, Tensor[], int, int?, int[]?, float, float?, bool, str or any."""

    name: str
    kind: str
    default: Any = REQUIRED
    kw_only: bool = False


def args(spec: str, kw_only: bool = False) -> Tuple[Arg, ...]:
    """Arguments from a compact 'kind name[=default], ...' string (defaults are Python literals)."""
    out = []
    for item in (s.strip() for s in re.split(r",\s*(?=(?:Tensor|int|float|bool|str|any)\b)", spec)):
        if not item:
            continue
        kind, rest = item.split(" ", 1)
        name, eq, default = rest.partition("=")
        out.append(Arg(name.strip(), kind, ast.literal_eval(default.strip()) if eq else REQUIRED, kw_only))
    return tuple(out)


def _kind_ok(kind: str, v: Any) -> bool:
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if v is None:
        return optional or base == "any"
    if base == "Tensor":
        return isinstance(v, torch.Tensor)
    if base == "Tensor[]":
        return isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v)
    if base == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if base == "int[]":  # SymInt[]: a host list of ints (a device tensor would need a sync to read)
        return isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if base == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if base == "bool":
        return isinstance(v, bool)
    if base == "str":
        return isinstance(v, str)
    return base == "any"


@dataclass(frozen=True)
class OpSchema:
    """An op's arguments as the vendor declares them, and where that declaration was read."""

    op: str
    args: Tuple[Arg, ...]
    source: str

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(a.name for a in self.args)

    def signature(self) -> inspect.Signature:
        kinds = {False: inspect.Parameter.POSITIONAL_OR_KEYWORD, True: inspect.Parameter.KEYWORD_ONLY}
        return inspect.Signature([inspect.Parameter(a.name, kinds[a.kw_only], default=a.default) for a in self.args])

    def bind(self, call_args: Sequence[Any], call_kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """Every argument by name (defaults filled in); VendorCallError naming what does not fit."""
        try:
            bound = self.signature().bind(*call_args, **call_kwargs)
        except TypeError as e:
            raise VendorCallError(f"{self.op}: {e} (the op takes {list(self.names)}; {self.source})") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        for a in self.args:
            if not _kind_ok(a.kind, values[a.name]):
                got = values[a.name]
                what = f"{type(got).__name__}" + (f" {got.dtype}" if isinstance(got, torch.Tensor) else "")
                raise VendorCallError(f"{self.op}: argument {a.name!r} must be {a.kind}, got {what}")
        return values


def require(cond: bool, op: str, message: str) -> None:
    """A constraint the vendor documents or asserts; VendorCallError when it does not hold."""
    if not cond:
        raise VendorCallError(f"{op}: {message}")


def require_dtype(op: str, name: str, t: Optional[torch.Tensor], dtypes: Sequence[torch.dtype]) -> None:
    if t is not None:
        require(t.dtype in tuple(dtypes), op, f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def require_dims(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    require(t.dim() == ndim, op, f"{name} must be {ndim}-D {layout}, got shape {list(t.shape)}")


@dataclass
class StandInOp:
    """A callable with the vendor op's schema: binds every call, then runs `impl(**bound)`."""

    schema: OpSchema
    impl: Callable[..., Any]
    calls: List[Dict[str, Any]] = field(default_factory=list)
    overloads: Dict[str, "StandInOp"] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arguments = [SimpleNamespace(name=a.name) for a in self.schema.args]
        self._schema = SimpleNamespace(name=self.schema.op, arguments=arguments)
        self.default = SimpleNamespace(_schema=self._schema)  # a torch OpOverloadPacket answers .default._schema
        self.__signature__ = self.schema.signature()         # a Python function answers inspect.signature

    def __getattr__(self, name: str) -> "StandInOp":
        overloads = self.__dict__.get("overloads", {})
        if name in overloads:  # e.g. npu_fused_infer_attention_score.out
            return overloads[name]
        raise AttributeError(name)

    def __call__(self, *a: Any, **kw: Any) -> Any:
        bound = self.schema.bind(a, kw)
        self.calls.append(bound)
        return self.impl(**bound)


def softmax_rows(scores: torch.Tensor, visible: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax over the last dim of `scores` [H, Q, K] where `visible`, with an optional sink logit per head
    [H] in the denominator; fully masked rows give zeros."""
    s = scores.masked_fill(~visible, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    if sinks is not None:
        mx = torch.maximum(mx, sinks.float().view(-1, 1, 1))
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    den = p.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks.float().view(-1, 1, 1) - mx)
    return p / den.clamp_min(1e-30)
