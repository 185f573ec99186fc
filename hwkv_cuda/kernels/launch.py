"""Plan once, launch directly: a kernel's compiled launcher, called without Triton's per-call dispatch.

`kernel[grid](...)` binds every argument, computes the specialisation key, looks the compiled kernel
up and only then launches: 22-28 us of host time per launch on the H200 host, against 7 us for the
compiled kernel's own launcher. A `Launch` goes through `kernel[grid]` once (which compiles, checks
and specialises), keeps the compiled kernel and its constexprs, and from then on calls the launcher
with the positional arguments. A call whose arguments would specialise differently from the first
(a pointer not 16-byte aligned where the first was, an int that turns 1, or divisible by 16, or wider
than 32 bits) goes through `kernel[grid]` again, so the direct path never runs another variant's code.
Under the interpreter (CI), and on Triton builds whose launcher convention is not known, every call
goes through `kernel[grid]`.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Dict, Hashable, Optional, Sequence, Tuple

import torch

try:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    # Triton >= 3.3 hands the launcher every bound argument (constexprs included); earlier releases only
    # the non-constexpr ones. Read it from the JIT's own launch code rather than guessing from a version.
    _SRC = inspect.getsource(JITFunction.run)
    _CONVENTION: Optional[str] = ("all" if "*bound_args.values()" in _SRC else
                                  "runtime" if "non_constexpr_vals" in _SRC else None)
except Exception:  # no source (a frozen install), or a Triton without JITFunction: launch through the JIT
    JITFunction, _CONVENTION, driver = None, None, None

I32 = (-2 ** 31, 2 ** 31)


def _spec(v: Any) -> Hashable:
    """What Triton specialises a runtime argument on: a pointer's dtype and 16-byte alignment, an int's width,
    being 1, divisibility by 16; None and bools by value. Floats are never specialised."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.get_device(), v.data_ptr() & 15 == 0
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return (v == 1, v & 15 == 0, _width(v))
    return 0


def _width(v: Any) -> Hashable:
    """An unspecialised int's type as Triton derives it: i32, i64 or u64 (anything else: its type)."""
    if type(v) is not int:
        return type(v)
    return 32 if I32[0] <= v < I32[1] else (64 if -2 ** 63 <= v < 2 ** 63 else 65)


def _kind(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return "t"
    return "f" if isinstance(v, float) else "v"


def _getter(positions: Tuple[int, ...]) -> Any:
    """args -> the tuple of args at `positions` (one C call; itemgetter of one index returns no tuple)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


class Launch:
    """One kernel launch planned: grid, constexprs and the compiled kernel (see module doc)."""

    __slots__ = ("kernel", "grid", "consts", "launcher", "function", "metadata", "tail", "device", "stream",
                 "tensors", "tensor_key", "values", "value_key", "value_types", "value_spec", "floats",
                 "float_types", "free", "free_key")

    def __init__(self, kernel: Any, grid: Tuple[int, ...], args: Sequence[Any], consts: Dict[str, Any]) -> None:
        self.kernel, self.consts = kernel, consts
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.launcher = None
        compiled = kernel[self.grid](*args, **consts)
        if _CONVENTION is None or JITFunction is None or not isinstance(kernel, JITFunction) or compiled is None:
            return
        tail = []
        for param in kernel.params[len(args):]:
            if param.name in consts:
                value = consts[param.name]
            elif param.has_default:
                value = param.default
            else:
                return  # a keyword-passed runtime argument: keep the JIT path
            if not param.is_constexpr:
                return
            if _CONVENTION == "all":
                tail.append(value)
        if any(p.is_constexpr for p in kernel.params[:len(args)]):
            return  # constexprs passed positionally: keep the JIT path
        # what a later call is compared with (see _same): tensors by dtype and alignment, ints/None/bools by
        # value, floats by type (Triton never specialises a float's value)
        # ints the kernel does not specialise on (do_not_specialize): only their width matters
        free = {i for i, p in enumerate(kernel.params[:len(args)]) if getattr(p, "do_not_specialize", False)}
        kinds = ["n" if i in free and _kind(a) == "v" else _kind(a) for i, a in enumerate(args)]
        pos = {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in ("t", "v", "f", "n")}
        self.tensors, self.values, self.floats, self.free = (_getter(pos[k]) for k in ("t", "v", "f", "n"))
        self.free_key = tuple(map(_width, self.free(args)))
        self.tensor_key = tuple([(a.dtype, a.get_device(), a.data_ptr() & 15) for a in self.tensors(args)])
        self.value_key, self.float_types = self.values(args), tuple(map(type, self.floats(args)))
        self.value_spec = tuple(map(_spec, self.value_key))
        self.value_types = tuple(map(type, self.value_key))  # 1 == True == 1.0, but Triton tells them apart
        self.tail = tuple(tail)
        self.launcher, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        self.device = dev.index if dev is not None and dev.index is not None else driver.active.get_current_device()
        self.stream = driver.active.get_current_stream  # the caller's current stream, read per launch

    @property
    def direct(self) -> bool:
        """Whether later calls skip the JIT's dispatch."""
        return self.launcher is not None

    def _same(self, args: Sequence[Any]) -> bool:
        """Whether `args` specialise as the first call's did: a few C-level tuple compares (~2-3 us for 25
        arguments, against ~8 us for `_spec` on each): tensors by dtype, device (a plan's compiled function
        belongs to one device) and alignment; other arguments by type, and ints that changed value by what
        Triton specialises them on. Anything unexpected says no, and the JIT decides."""
        try:
            values = self.values(args)
            return (tuple(map(type, values)) == self.value_types
                    and (values == self.value_key or tuple(map(_spec, values)) == self.value_spec)
                    and tuple([(a.dtype, a.get_device(), a.data_ptr() & 15)
                               for a in self.tensors(args)]) == self.tensor_key
                    and tuple(map(type, self.floats(args))) == self.float_types
                    and tuple(map(_width, self.free(args))) == self.free_key)
        except (AttributeError, RuntimeError, TypeError):
            return False

    def __call__(self, *args: Any) -> None:
        if self.launcher is not None and self._same(args):
            g = self.grid
            self.launcher(g[0], g[1], g[2], self.stream(self.device), self.function, self.metadata, None, None, None, *args, *self.tail)
        else:
            self.kernel[self.grid](*args, **self.consts)


def launch(plans: Dict[Hashable, Launch], key: Hashable, kernel: Any, grid: Tuple[int, ...], args: Sequence[Any],
           consts: Dict[str, Any]) -> None:
    """Launch `kernel` through the plan stored under `key` (the key fixes the grid and the constexprs),
    planning it at its first call. A table past 256 plans starts over (keys that hold token counts grow)."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= 256:
            plans.clear()
        plans[key] = Launch(kernel, grid, args, consts)
    else:
        plan(*args)
