"""Argument checks at the boundary: each names the argument, what was expected and what came."""
from __future__ import annotations

import functools
import math
import numbers
import operator
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import torch

from hwkv.env import HWKV_DEBUG
from hwkv.errors import ConfigError, DeviceError, LocError, ShapeError


F = TypeVar("F", bound=Callable[..., Any])


def normal_tensors(make: F) -> F:
    """Decorates a constructor of long-lived state (pools, allocators, request table, backend): its tensors are made
    as normal tensors even under `torch.inference_mode()`, so steps run later in any grad mode may update them in
    place (an inference tensor refuses that outside inference mode, with torch's raw error)."""
    @functools.wraps(make)
    def made(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False):
            return make(*args, **kwargs)
    return made  # type: ignore[return-value]


def values_checkable(t: torch.Tensor) -> bool:
    """Value checks (min/max) cost a host sync on accelerators: always on CPU, else only in debug mode;
    never on meta tensors, nor while torch.compile traces (a value read there re-specializes the graph on every
    call)."""
    if torch.compiler.is_compiling() or t.device.type == "meta":  # (a meta tensor holds no values)
        return False
    if t.device.type == "cpu":
        return True
    if not HWKV_DEBUG.get():
        return False
    is_capturing = getattr(getattr(torch, t.device.type, None), "is_current_stream_capturing", None)
    return not (is_capturing and is_capturing())


def is_int(x: Any) -> bool:
    """A Python int, not a bool (options and sizes given as plain ints)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_bool(x: Any) -> bool:
    """A Python, numpy or torch bool (a bool tensor of any shape): no integer, though `operator.index` reads torch's
    as one."""
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool)


def as_layer_id(x: Any) -> Optional[int]:
    """A layer id as an int >= 0 (Python, numpy and 0-d tensor integers); None for anything else: a bool or float
    would find another layer in a pool."""
    i = as_int(x)
    return i if i is not None and i >= 0 else None


def as_int(x: Any) -> Optional[int]:
    """An integer value as an int (Python, numpy and one-element tensor integers); None for anything else, a bool of
    any kind included (`is_bool`: True would read as 1). Where a tensor may stand for something else (a one-token
    loc is no token count), `as_count` takes scalars only."""
    if is_bool(x):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def as_count(x: Any) -> Optional[int]:
    """`as_int` of a scalar: a tensor of any dimension other than 0 is None (`operator.index` takes a one-element
    1-D tensor, so `cp_plan(loc)` of one token had read its slot as a count)."""
    return None if isinstance(x, torch.Tensor) and x.dim() != 0 else as_int(x)


def items_of(value: Any) -> Optional[List[Any]]:
    """Any iterable's items (a generator's too), None for text, a mapping or what does not iterate."""
    if isinstance(value, (str, bytes, bytearray, Mapping)):
        return None
    try:
        return list(value)
    except TypeError:
        return None


def check_batch_sizes(name: str, value: Any, empty: bool = False) -> List[int]:
    """Graph bucket sizes as ints: an iterable (non-empty unless `empty`) of integers >= 1 (numpy and 0-d tensor
    integers taken; a bool, a float or text is none), else a ConfigError naming `name`, before anything is built."""
    items = items_of(value)
    sizes = [as_int(b) for b in items] if items is not None and (items or empty) else [None]
    if any(b is None or b < 1 for b in sizes):
        raise ConfigError(f"{name} must be integers >= 1 (a list, tuple or set{'' if empty else ', non-empty'}), got "
                          f"{items if items is not None else value!r}")
    return sizes  # type: ignore[return-value]


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view the same memory the same way (their values cannot disagree)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride())


def check_host_copy(name: str, x: torch.Tensor, host: torch.Tensor) -> None:
    """Where both are readable for free (x on the CPU), x's values equal its host copy's, entry for entry (same
    count, checked by the caller): a LocError naming the first difference, as a call sizing from the host copy
    and computing slots from x would go wrong."""
    if x.device.type != "cpu" or same_view(x, host):
        return
    if host.is_meta:
        raise LocError(f"{name}'s host copy is on meta: it holds no values to read")
    mine, theirs = x.reshape(-1).to(torch.int64), host.reshape(-1).to("cpu", torch.int64)
    if not torch.equal(mine, theirs):
        i = int(torch.argmax((mine != theirs).to(torch.int8)))
        raise LocError(f"{name}[{i}] is {int(mine[i])} but its host copy holds {int(theirs[i])}: the call "
                       "would size from one and compute slots from the other")


def check_tensors(**named: Any) -> None:
    """Each named argument is a torch.Tensor (`sinks` and `mask` may be None): a ShapeError naming the first that is
    not (a list or an ndarray had been a bare AttributeError in the kernels' and the reference's shape checks)."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name in ("sinks", "mask")):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_on_device(name: str, x: Any, device: torch.device, holder: str) -> None:
    """A tensor argument lies on its holder's device type or on the CPU (host copies): a LocError naming both
    otherwise (a meta tensor holds no values; another device's cannot be indexed), before any value is read."""
    if isinstance(x, torch.Tensor) and x.device.type not in ("cpu", device.type):
        raise LocError(f"{name} is on {x.device}, the {holder} is on {device}")


def check_window(window: Any) -> int:
    """A model's sliding window W as an int, 0 for none (None or <= 0); a value that is no integer (a float, a
    string, a bool) is a ConfigError naming it."""
    if window is None:
        return 0
    w = as_int(window)
    if w is None:
        raise ConfigError(f"window={window!r} must be an integer (the model's sliding_window W; None or 0: no window)")
    if w >= 2 ** 63:   # positions are int64: such a window covers every list, and numpy/torch cannot hold it
        raise ConfigError(f"window={w} must be below 2**63 (positions are int64)")
    return max(w, 0)


def release_window(window: Any, hybrid: bool, model_window: int, context: int, page_size: int,
                   name: str) -> Optional[int]:
    """The window an out-of-window release keeps (an engine's, a whole-step graph's), checked against its pools:
    None for pools without an SWA pool (nothing slides out); over hybrid pools an integer >= the model's sliding
    window `model_window` (the largest W its SWA layers read; a larger one releases later and keeps more) or, where
    the rows' `context` is shorter than that, >= context - page_size + 1 (under which nothing ever slides out: the
    release keeps a page of margin and no request continues past context). ConfigError naming the value and the
    bound otherwise (`name`: whose pools, as the message shows it): a smaller window frees slots the layers still
    read (wrong tokens), None over hybrid pools releases nothing (the SWA pool runs out mid-run), a window over full
    pools has no SWA to release, one of 2**63 or more is no int64 (as layers refuse it). A window past context +
    page_size releases nothing, as that one does (no request continues past context): it is returned as context +
    page_size, so that the release's int64 arithmetic (seq_len - W + 1, rounded down to a page, less a page) never
    overflows."""
    if not hybrid:
        if window is not None:
            raise ConfigError(f"window={window!r}, but the pools of {name} have no SWA pool (every layer is full "
                              "attention): give window=None")
        return None
    w, least = as_int(window), min(model_window, context - page_size + 1)
    if w is None or not least <= w < 2**63:
        raise ConfigError(f"window={window!r} for the hybrid pools of {name}: must be an integer >= {least} (the "
                          f"model's sliding window {model_window}, or context {context} - page_size {page_size} + 1 "
                          "where smaller: nothing slides out then) and < 2**63; a smaller window frees slots the SWA "
                          "layers still read, None never frees any")
    return min(w, context + page_size)


def check_device(device: Union[str, torch.device]) -> torch.device:
    """`device` as a torch.device whose runtime is present (DeviceError naming it and why not), before any
    buffer is allocated on it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceError(f"device={device!r} is not a torch device: {str(e).splitlines()[0]}") from None
    if dev.type in ("cpu", "meta"):
        return dev
    mod = getattr(torch, dev.type, None)
    available = getattr(mod, "is_available", None)
    if available is not None and not available():
        raise DeviceError(f"device={str(device)!r}: torch.{dev.type}.is_available() is False "
                          f"(torch {torch.__version__}; see `hwkv info`)")
    count = getattr(mod, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise DeviceError(f"device={str(device)!r}: torch sees {count()} {dev.type} device(s), index {dev.index} "
                          "is out of range")
    return dev


SMALL = 64  # integer tensors up to this many entries are read as a host list (no op dispatched) for their range


def value_range(t: torch.Tensor) -> Tuple[int, int]:
    """(min, max) of a non-empty integer tensor whose values are checkable (`values_checkable`): a host list when
    small, one aminmax pass on a larger CPU tensor, min and max elsewhere (debug mode; every device's torch has
    them)."""
    if t.numel() <= SMALL:
        vals = t.reshape(-1).tolist()
        return min(vals), max(vals)
    if t.device.type == "cpu":
        lo, hi = torch.aminmax(t)
    else:
        lo, hi = t.min(), t.max()
    return int(lo), int(hi)


def check_int_dtype(name: str, x: object) -> None:
    """A tensor argument of rows, locs or lengths must hold integers, a bool being none (True would read as 1): its
    dtype, a host attribute, no device read. What is no tensor is its caller's to check."""
    if isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
        raise LocError(f"{name} must hold integers, got {x.dtype}")


def check_index_tensor(name: str, loc: torch.Tensor, device: Optional[torch.device] = None,
                       ndim: Optional[int] = 1) -> None:
    """`loc` must be an int64 tensor of `ndim` dimensions (None: any), on `device` when given (its index too,
    when `device` names one); a 1-D one (ndim=1) of unit stride, as the kernels read it. Host attributes only:
    never reads a value."""
    if not isinstance(loc, torch.Tensor):
        raise LocError(f"{name} must be a torch.Tensor, got {type(loc).__name__}")
    if loc.dtype != torch.int64:
        raise LocError(f"{name} must be int64, got {loc.dtype}")
    if ndim is not None and loc.dim() != ndim:
        raise LocError(f"{name} must be {ndim}-D, got shape {tuple(loc.shape)}")
    if ndim == 1 and loc.stride(0) != 1 and loc.shape[0] > 1:
        raise LocError(f"{name} has stride {loc.stride(0)}; index lists must have stride 1 (the kernels read them "
                       f"so): pass {name.rsplit('.', 1)[-1]}.contiguous(), not a strided view such as locs[:, 0]")
    if device is not None and loc.device != device:  # equal: the common case, no torch.device built
        dev = torch.device(device)
        if loc.device.type != dev.type or (dev.index is not None and loc.device.index != dev.index):
            raise LocError(f"{name} is on {loc.device}, the pool is on {device}")


def check_loc(name: str, loc: torch.Tensor, limit: int, device: torch.device, low: int = 0,
              ndim: Optional[int] = 1) -> None:
    """`loc` must be an int64 tensor of `ndim` dimensions (1 unless given; None: any) on `device` (its index
    too, when `device` names one) with values in [low, limit) (values checked where `values_checkable`)."""
    check_index_tensor(name, loc, device, ndim)
    if loc.numel() and values_checkable(loc):
        lo, hi = value_range(loc)
        if lo < low or hi >= limit:
            raise LocError(f"{name} holds values in [{lo}, {hi}], allowed range is [{low}, {limit})")


def check_rows(req_pool_indices: torch.Tensor, rows: int, distinct: Optional[str] = None,
               repeat_error: type = LocError) -> None:
    """Request rows inside a ReqToTokenPool of `rows` rows (LocError), read where values are checkable (CPU; elsewhere
    only with HWKV_DEBUG, never while capturing): the one row check of the metadata steps and the draft accept.
    `distinct`: an op that takes each request once (its words end the message): a row named twice is a
    `repeat_error` too, found in the same read (a set of the host list; above SMALL entries one sort, which gives
    the range as well)."""
    n = req_pool_indices.numel()
    if not n or not values_checkable(req_pool_indices):
        return
    repeat = False
    if n <= SMALL:
        vals = req_pool_indices.reshape(-1).tolist()
        lo, hi = min(vals), max(vals)
        repeat = distinct is not None and len(set(vals)) != n
    elif distinct is None:
        lo, hi = value_range(req_pool_indices)
    else:
        ordered = np.sort(req_pool_indices.reshape(-1).cpu().numpy())
        lo, hi = int(ordered[0]), int(ordered[-1])
        repeat = bool((ordered[1:] == ordered[:-1]).any())
    if lo < 0 or hi >= rows:
        raise LocError(f"req_pool_indices hold values in [{lo}, {hi}], allowed range is [0, {rows}) (the "
                       "ReqToTokenPool's rows)")
    if repeat:  # refused: name the first repeated row's two entries
        a = req_pool_indices.reshape(-1).cpu().numpy()
        order = np.argsort(a, kind="stable")
        first = int(np.flatnonzero(a[order][1:] == a[order][:-1])[0])
        i, j = sorted((int(order[first]), int(order[first + 1])))
        raise repeat_error(f"req_pool_indices name request row {int(a[i])} twice (entries {i} and {j}): {distinct}")


def first_repeat(a: np.ndarray) -> Optional[int]:
    """The smallest value a host array holds twice, or None: one sort and one compare in numpy, no Python per
    value."""
    if a.size < 2:
        return None
    b = np.sort(a, axis=None)
    same = b[1:] == b[:-1]
    return int(b[1:][same][0]) if same.any() else None


def check_shape(name: str, t: torch.Tensor, expected: Sequence[Optional[int]]) -> None:
    """`t.shape` must match `expected` (None = any size in that dimension)."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ShapeError(f"{name} has shape {list(t.shape)}, expected {want}")


def _check_scale_float(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={value!r} must be a finite number > 0 (K/V are stored divided by it)")
    return value


def _scale_number(name: str, scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ConfigError(f"{name}={scale!r} must be a finite number > 0 or a one-element tensor, "
                          f"got {type(scale).__name__}")
    return float(scale)


def scale_value(name: str, scale: Union[None, float, int, torch.Tensor]) -> float:
    """A K/V scale as a host float (None -> 1.0), finite and > 0 (ConfigError naming it otherwise). A
    tensor scale costs one host read: layers convert theirs once at construction, so kernels on the hot
    path only ever see floats."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ShapeError(f"{name} must be a scalar, got shape {list(scale.shape)}")
        return _check_scale_float(name, float(scale.item()))
    return _check_scale_float(name, _scale_number(name, scale))


def check_scale(name: str, scale: Union[None, float, int, torch.Tensor]) -> None:
    """A K/V scale handed to a store: None, or finite and > 0. A host number is checked always (no sync); a
    tensor's shape always, its value only where `values_checkable` (so accelerators never sync)."""
    if type(scale) is float and 0.0 < scale < math.inf:  # the common case, one compare (NaN fails it too)
        return
    if isinstance(scale, torch.Tensor) and not values_checkable(scale):
        if scale.numel() != 1:
            raise ShapeError(f"{name} must be a scalar, got shape {list(scale.shape)}")
        return
    scale_value(name, scale)


def check_int_option(name: str, value: Any, lo: int, none: bool = False) -> None:
    """An integer option (a size, a count) must be an int (a bool is not) >= lo, or with `none` None (ConfigError
    naming it)."""
    if not (none and value is None) and (not is_int(value) or value < lo):
        raise ConfigError(f"{name} must be an integer >= {lo}{' or None' if none else ''}, got {value!r}")


def check_max_q_len(max_q_len: Any) -> None:
    """An extend kernel's bound on a request's query rows (it sizes the grid): an integer (numpy's and torch's too, a
    bool not) in [0, 2**63), ConfigError naming it otherwise (None had been a bare TypeError, 2**70 the op schema's
    RuntimeError)."""
    _check_len_bound("max_q_len", max_q_len, "the longest request's query rows")


def check_max_kv_len(max_kv_len: Any) -> None:
    """A decode kernel's bound on a request's key list (it sizes the split grid), as `check_max_q_len`, or None
    (unknown): inf had been a bare OverflowError, text a TypeError."""
    if max_kv_len is not None:
        _check_len_bound("max_kv_len", max_kv_len, "the longest key list; None: unknown")


def _check_len_bound(name: str, value: Any, what: str) -> None:
    v = as_int(value)
    if v is None or not 0 <= v < 2 ** 63:
        raise ConfigError(f"{name} must be an integer in [0, 2**63) ({what}), got {value!r}")


def check_flag(name: str, value: Any, none: bool = False) -> None:
    """An on/off option must be True or False (with `none`, None too: "decide for me"); ConfigError naming it
    otherwise, as `hwkv.engine.plan.plan` refuses prefix_cache: a truthy "no" or 1 would read as on."""
    if not (isinstance(value, bool) or (none and value is None)):
        raise ConfigError(f"{name} must be True{', False or None' if none else ' or False'}, got {value!r}")


FLOAT32_MAX = float(torch.finfo(torch.float32).max)   # 3.4028234663852886e+38
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # 1.1754943508222875e-38: the smallest normal
LOGIT_CAP_LIMITS = (f"at most float32's largest, {FLOAT32_MAX!r}, and if > 0 at least its smallest normal, "
                    f"{FLOAT32_TINY!r} (the kernels soft-cap in float32)")


def logit_cap_ok(cap: Any) -> bool:
    """A logit soft-cap the kernels can apply: 0 (off), or a float32 number that is neither inf there (every output
    NaN) nor so small that the scale over it overflows; a bool is no cap."""
    return not isinstance(cap, bool) and isinstance(cap, numbers.Real) and (
        cap == 0 or FLOAT32_TINY <= cap <= FLOAT32_MAX)


def check_sink_values(sinks: torch.Tensor, where: str = "") -> None:
    """Refuse sinks holding NaN or +inf (ConfigError naming the head) where their values are checkable (CPU; any
    device in debug mode): NaN makes every output row NaN, +inf gave NaN on the CPU kernels where the reference and
    the Triton kernels give zeros. -inf (no sink) is a logit like any other."""
    if sinks.is_floating_point() and values_checkable(sinks):
        bad = (torch.isnan(sinks) | (sinks == float("inf"))).reshape(-1)
        if bool(bad.any()):
            head = int(bad.nonzero()[0, 0])
            raise ConfigError(f"{where}sinks[{head}] is {float(sinks.reshape(-1)[head])}: every sink must be a finite "
                              "logit (or -inf for none)")


def check_attention_options(scaling: Any, window: Any, logit_cap: Any, sinks: Optional[torch.Tensor] = None) -> None:
    """An attention call's options by the reference's rule (ConfigError naming the value): a finite scaling (None:
    1/sqrt(D)), window None or an integer >= 0, logit_cap None, 0 or a float32 number > 0 (`logit_cap_ok`), and the
    sinks' values where checkable (`check_sink_values`). The kernels' public entry points run it; a layer checked the
    same when it was made."""
    if scaling is not None and (isinstance(scaling, bool) or not isinstance(scaling, numbers.Real)
                                or not math.isfinite(scaling)):
        raise ConfigError(f"scaling={scaling!r} must be a finite number (the softmax scale; None for 1/sqrt(D))")
    w = None if window is None else as_int(window)
    if window is not None and (w is None or not 0 <= w < 2 ** 63):   # (positions are int64, as the layer says)
        raise ConfigError(f"window={window!r} must be None or an integer >= 0 and below 2**63 (None or 0: no window)")
    if logit_cap is not None and not logit_cap_ok(logit_cap):
        raise ConfigError(f"logit_cap={logit_cap!r} must be a finite number >= 0 (None or 0 = off), {LOGIT_CAP_LIMITS}")
    if sinks is not None:
        check_sink_values(sinks)
