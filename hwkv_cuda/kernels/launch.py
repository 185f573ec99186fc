"""Plan once, launch directly: a kernel's compiled launcher, called without Triton's per-call dispatch.

`kernel[grid](...)` binds every argument, computes the specialisation key, looks the compiled kernel
up and only then launches: 22-28 us of host time per launch on the H200 host, against 7 us for the
compiled kernel's own launcher. A `Launch` goes through `kernel[grid]` once (which compiles, checks
and specialises), keeps the compiled kernel and its constexprs, and from then on calls the launcher
with the positional arguments. A call whose arguments would specialise differently from the first
(a pointer not 16-byte aligned where the first was, an int that turns 1, or divisible by 16, or wider
than 32 bits) goes through `kernel[grid]` once more and gets a plan of its own, so the direct path never
runs another variant's code. Where the launcher's own Python call is understood (`_fast_launcher`), a plan
calls the C launch function under it directly. Under the interpreter (CI), and on Triton builds whose launcher convention is not known, every call
goes through `kernel[grid]`.
"""
from __future__ import annotations

import ast
import inspect
import operator
import textwrap
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


# what the launcher's own __call__ passes on, by name: its parameters, and the scratch buffers it allocates
_CALL_PARAMS = ("gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
                "launch_enter_hook", "launch_exit_hook")
_NONE_WHEN_EMPTY = {"global_scratch": "global_scratch_size", "profile_scratch": "profile_scratch_size"}
_FAST: Dict[type, Any] = {}


def _fast_launcher(launcher: Any) -> Any:
    """The C launch function under a compiled kernel's Python launcher, called as that launcher's __call__ would
    call it, or None. Triton's launcher __call__ (Python, ~10 us on the H200 host) looks up allocators and knobs
    each call only to pass None for scratch buffers a kernel without scratch never gets; the argument order of
    its one `self.launch(...)` call differs between releases, so it is read from that call's source: names of
    __call__'s parameters, `self.<attr>` constants, the two scratch buffers (only when their sizes are 0) and
    the kernel arguments (`*args` or `args`). Anything else, or a launcher with GSan on: None."""
    cls = type(launcher)
    if cls not in _FAST:
        _FAST[cls] = _launch_template(cls)
    tpl = _FAST[cls]
    if tpl is None or getattr(launcher, "gsan_enabled", False) or not callable(getattr(launcher, "launch", None)):
        return None
    code, attrs, scratch = tpl
    if any(getattr(launcher, size, 0) for size in scratch):
        return None
    # a lambda over its parameters, the C function and the constants only (see _launch_template)
    return eval(code, {"__builtins__": {}, "C": launcher.launch, "K": tuple(getattr(launcher, a) for a in attrs)})


def _launch_template(cls: type) -> Any:
    """(lambda source, self attributes it reads, scratch sizes that must be 0) for `cls.__call__`, or None."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "launch" and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    if len(calls) != 1 or calls[0].keywords:
        return None
    names = {"gridX": "g0", "gridY": "g1", "gridZ": "g2", "stream": "stream", "function": "function",
             "kernel_metadata": "metadata", "launch_metadata": "None", "launch_enter_hook": "None",
             "launch_exit_hook": "None"}
    # releases whose __call__ takes (grid, stream, function, *args) get the kernel metadata and the launch
    # metadata and hooks at the head of args, as the JIT passes them
    params = [a.arg for a in tree.body[0].args.args] if isinstance(tree.body[0], ast.FunctionDef) else []
    head = "" if "kernel_metadata" in params else "metadata, None, None, None, "
    out, attrs, scratch = [], [], []
    for a in calls[0].args:
        if isinstance(a, ast.Starred) and isinstance(a.value, ast.Name) and a.value.id in ("args", "kernel_args"):
            out.append(head + "*args")
        elif isinstance(a, ast.Name) and a.id in ("args", "kernel_args") and not head:
            out.append("args")
        elif isinstance(a, ast.Name) and a.id in names:
            out.append(names[a.id])
        elif isinstance(a, ast.Name) and a.id in _NONE_WHEN_EMPTY:
            out.append("None")
            scratch.append(_NONE_WHEN_EMPTY[a.id])
        elif isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self":
            out.append(f"K[{len(attrs)}]")
            attrs.append(a.attr)
        else:
            return None
    if sum(o.endswith("*args") or o == "args" for o in out) != 1:
        return None
    return (f"lambda g0, g1, g2, stream, function, metadata, args: C({', '.join(out)})", tuple(attrs),
            tuple(scratch))


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

    __slots__ = ("kernel", "grid", "consts", "launcher", "fast", "function", "metadata", "tail", "device",
                 "stream", "tensors", "tensor_key", "values", "value_key", "value_types", "value_spec", "floats",
                 "float_types", "free", "free_key", "variants", "device_id", "jit_calls", "free_last")

    def __init__(self, kernel: Any, grid: Tuple[int, ...], args: Sequence[Any], consts: Dict[str, Any]) -> None:
        self.kernel, self.consts = kernel, consts
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.launcher = self.fast = None
        self.variants: Dict[Hashable, "Launch"] = {}
        self.jit_calls = 1  # launches through kernel[grid] (this one included): the profile counts them
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
        self.free_last = self.free(args)
        self.free_key = tuple(map(_width, self.free_last))
        self.tensor_key = tuple([(a.dtype, a.data_ptr() & 15) for a in self.tensors(args)])
        self.device_id = self.tensors(args)[0].get_device() if self.tensors(args) else None
        self.value_key, self.float_types = self.values(args), tuple(map(type, self.floats(args)))
        self.value_spec = tuple(map(_spec, self.value_key))
        self.value_types = tuple(map(type, self.value_key))  # 1 == True == 1.0, but Triton tells them apart
        self.tail = tuple(tail)
        self.launcher, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.fast = _fast_launcher(compiled.run)
        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        self.device = dev.index if dev is not None and dev.index is not None else driver.active.get_current_device()
        self.stream = driver.active.get_current_stream  # the caller's current stream, read per launch

    @property
    def direct(self) -> bool:
        """Whether later calls skip the JIT's dispatch."""
        return self.launcher is not None

    def _same(self, args: Sequence[Any]) -> bool:
        """Whether `args` specialise as the first call's did, in a few C-level tuple compares: tensors by dtype
        and alignment (and the first one's device: a plan's compiled function belongs to one device), other
        arguments by type, and ints that changed value by what Triton specialises them on. Anything
        unexpected says no, and the JIT decides."""
        try:
            values, tensors, frees = self.values(args), self.tensors(args), self.free(args)
            if tuple(map(type, values)) != self.value_types:
                return False
            if values != self.value_key:  # ints that moved: what Triton sees of them must not have
                if tuple(map(_spec, values)) != self.value_spec:
                    return False
                self.value_key = values  # a plan called again with these values compares them as a tuple
            if frees != self.free_last:
                if tuple(map(_width, frees)) != self.free_key:
                    return False
                self.free_last = frees
            return (tuple([(a.dtype, a.data_ptr() & 15) for a in tensors]) == self.tensor_key
                    and (not tensors or tensors[0].get_device() == self.device_id)
                    and tuple(map(type, self.floats(args))) == self.float_types)
        except (AttributeError, RuntimeError, TypeError):
            return False

    def _go(self, args: Sequence[Any]) -> None:
        """The launch itself, through the C launch function where known, else the launcher."""
        g = self.grid
        if self.fast is not None:
            self.fast(g[0], g[1], g[2], self.stream(self.device), self.function, self.metadata, (*args, *self.tail))
        else:
            self.launcher(g[0], g[1], g[2], self.stream(self.device), self.function, self.metadata, None, None, None,
                          *args, *self.tail)

    def __call__(self, *args: Any) -> None:
        if self.launcher is None:
            self.jit_calls += 1
            self.kernel[self.grid](*args, **self.consts)
        elif self._same(args):
            self._go(args)
        else:  # another specialisation under the same key (e.g. a buffer at another alignment): a plan of its own
            try:
                sig: Hashable = tuple(map(_spec, args))
                hash(sig)
            except TypeError:
                self.jit_calls += 1
                self.kernel[self.grid](*args, **self.consts)
                return
            other = self.variants.get(sig)
            if other is None:
                if len(self.variants) >= 8:
                    self.variants.clear()
                self.variants[sig] = Launch(self.kernel, self.grid, args, self.consts)  # launches through the JIT
            elif other.launcher is not None:
                other._go(args)
            else:
                other.jit_calls += 1
                other.kernel[other.grid](*args, **other.consts)


def current_stream(device: torch.device) -> int:
    """The raw handle of the current stream on `device` (what a launch goes to), 0 off a GPU driver or under the
    interpreter: keys plans whose scratch must not be shared by calls that may run concurrently."""
    if driver is None or device.type == "cpu":
        return 0
    try:
        return driver.active.get_current_stream(device.index if device.index is not None else
                                                driver.active.get_current_device())
    except Exception:  # a driver without streams (the interpreter's)
        return 0


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
