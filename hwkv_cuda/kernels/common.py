"""Helpers shared by the Triton kernels: interpreter detection, launch sizes, jit helpers.

Under `TRITON_INTERPRET=1` (CPU CI) the kernels run with tiny blocks, and every `tl.dot`
goes through fp32 because the interpreter multiplies bf16 operands as raw uint16.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, Sequence, Union

import torch
import triton
import triton.language as tl

from hwkv.checks import scale_value
from hwkv.errors import DeviceError
from hwkv.ops import FP8_DTYPES

LOG2E = tl.constexpr(1.4426950408889634)
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) free of NaN

FP8_MAX = {d: float(torch.finfo(d).max) for d in FP8_DTYPES}


def as_scale(scale: Union[None, float, int, torch.Tensor], name: str = "k_scale/v_scale") -> float:
    """K/V scale as a host float: the core's one definition (`hwkv.checks.scale_value`; `name` in its errors)."""
    return scale_value(name, scale)


_TRUE = ("1", "true", "yes", "on", "y")   # what Triton's getenv_bool takes for on


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (read at call time, not import time), by Triton's own
    reading of TRITON_INTERPRET: 1, true, yes, on or y in any case; anything else ("false", "off", "2") is off."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


def request_block(bs: int) -> "tuple[int, int]":
    """(BLOCK, programs) of a kernel taking a batch's requests a block at a time: one program up to 1024 requests
    (16 a program under the interpreter, so CI runs several)."""
    block = 16 if interpreting() else max(16, min(1024, 1 << max(int(bs) - 1, 0).bit_length()))
    return block, -(-int(bs) // block)


def jit_interpreted(kernel: object) -> bool:
    """Whether Triton decorated `kernel` for its interpreter (decided at decoration, unlike `interpreting()`,
    which reads the environment now): launch sizes must follow what the kernel will actually run as."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def hopper_class(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability >= 9.0 (H100/H200 and later; not ROCm): the devices the
    shared-memory-hungry configs were recorded on. Elsewhere the kernels keep their portable configs."""
    if interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def fast_tanh_for(device: torch.device, f32: bool) -> bool:
    """Whether a soft-capped kernel on `device` takes the hardware's tanh (`TANH_APPROX`, PTX `tanh.approx.f32`,
    sm_75+): an NVIDIA GPU, not ROCm or the interpreter, and not the fp32 kernels, whose outputs are held to fp32
    tolerances (the approximation's relative error is below 2**-10.9)."""
    if f32 or interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (7, 5)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> "tuple[int, int]":
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (Xe-cores on XPU; a small stand-in under the interpreter)."""
    if interpreting():
        return 2
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "musa":  # torch.musa is registered by torch_musa, which only the MUSA user imports
        musa = getattr(torch, "musa", None)
        if musa is None:
            raise DeviceError("a 'musa' tensor but torch.musa is not registered: import torch_musa first")
        return int(musa.get_device_properties(device).multi_processor_count)
    if device.type == "xpu":  # an Xe-core (subslice) is the SM's counterpart
        props = torch.xpu.get_device_properties(device)
        return int(getattr(props, "gpu_subslice_count", 0) or props.max_compute_units)
    return 2


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, in plain Python: `triton.cdiv` goes through Triton's constexpr-function call
    machinery on recent releases (~4 us a call on the host), and plans call it every forward."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1), in plain Python (see `cdiv`)."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


def pow2(n: int, floor: int = 16) -> int:
    """Next power of two >= max(n, floor): tl.arange and tl.dot need power-of-two sizes >= 16."""
    return max(floor, next_pow2(max(int(n), 1)))


def build_for_sm90(kernel: Any, sig: Dict[str, str], consts: Dict[str, Any], aligned: Sequence[str],
                   options: Dict[str, Any], source: Any = None) -> Any:
    """Compile `kernel` for an sm_90 target without a GPU (TTGIR -> PTX -> cubin through the wheel's ptxas): `sig`
    types its runtime parameters, `consts` fixes its constexprs, and the parameters in `aligned` get the 16-byte
    divisibility the JIT gives real launches (aligned pointers, strides). `source`: Triton's ASTSource by default,
    Gluon's for a Gluon kernel. For CI and for checking a Triton upgrade without a Hopper GPU."""
    from triton.backends.compiler import GPUTarget
    if source is None:
        from triton.compiler import ASTSource as source
    names = list(kernel.arg_names)                         # the kernel's parameter order
    full = dict(sig, **{k: "constexpr" for k in consts})
    src = source(kernel, {n: full[n] for n in names}, constexprs={(names.index(k),): v for k, v in consts.items()},
                 attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def dot_in_fp32(q: torch.Tensor) -> bool:
    """Whether tl.dot runs in exact fp32: fp32 queries (no tf32), and always under the interpreter."""
    return q.dtype == torch.float32 or interpreting()


@triton.jit
def dot(a, b, F32: tl.constexpr):
    """a @ b accumulated in fp32; F32: exact fp32 operands (fp32 inputs, or the interpreter)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# tanh(x) = 1 - 2 / (exp(2x) + 1) loses |x| to cancellation near 0: its absolute error is ~1e-7 whatever x, so a large
# cap (s / cap tiny) got logits off by ~cap * 1e-7 (outputs off by 0.08 at cap 1e6, uniform attention at 1e8).
# Below TANH_SERIES_BELOW the series x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835 is used instead: in float32 it is
# within ~1 ulp of tanh up to 0.3, and the exp form within ~6 ulp from there on (both measured against float64 tanh).
TANH_SERIES_BELOW = tl.constexpr(0.3)
_T3 = tl.constexpr(-1.0 / 3.0)
_T5 = tl.constexpr(2.0 / 15.0)
_T7 = tl.constexpr(-17.0 / 315.0)
_T9 = tl.constexpr(62.0 / 2835.0)


@triton.jit
def tanh_fp32(x):
    """tanh in float32 to a few ulp, for any x: the exp form (saturates cleanly at +-1) or, for |x| <
    TANH_SERIES_BELOW, the odd series, exact to rounding where the exp form cancels (a compare, a select and six
    multiply-adds more)."""
    x2 = x * x
    series = x + x * x2 * (_T3 + x2 * (_T5 + x2 * (_T7 + x2 * _T9)))
    return tl.where(tl.abs(x) < TANH_SERIES_BELOW, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


# the hardware's tanh (one special-function op; relative error below 2**-10.9), for inline PTX where `fast_tanh_for`
# allows it: the exact form costs an exp and a division a score on top of the softmax's exp, which made a capped
# prefill 3-4x an uncapped one (docs/benchmarks.md)
TANH_APPROX = tl.constexpr("tanh.approx.f32 $0, $1;")


@triton.jit
def logits_log2(qk, qk_scale, cap, HAS_CAP: tl.constexpr):
    """Raw q.k -> logits in log2 units: scale, optional soft-cap cap * tanh(s / cap), times log2(e). With a cap,
    qk_scale / cap is folded once: no division by the cap a logit. HAS_CAP 2: the hardware's tanh (TANH_APPROX)."""
    if HAS_CAP == 2:
        t = tl.inline_asm_elementwise(TANH_APPROX, "=f,f", [qk * (qk_scale / cap)], dtype=tl.float32, is_pure=True,
                                      pack=1)
        return t * cap * LOG2E
    if HAS_CAP:
        return tanh_fp32(qk * (qk_scale / cap)) * cap * LOG2E   # (t * cap) * log2(e): cap * log2(e) may overflow
    return qk * (qk_scale * LOG2E)   # one multiply per logit; the scalar product is folded once


@triton.jit
def online_softmax_step(m, l_sum, acc, s, vt, F32: tl.constexpr):
    """Fold one key tile (log2 logits s [..., M, N], values vt [..., N, Dv]; leading dims a batch of dots) into the
    running max/sum/acc."""
    m_new = tl.maximum(m, tl.max(s, -1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - tl.expand_dims(m_new, -1))
    l_sum = l_sum * alpha + tl.sum(p, -1)
    acc = acc * tl.expand_dims(alpha, -1) + dot(p.to(vt.dtype), vt, F32)
    return m_new, l_sum, acc


@triton.jit
def fold_sink(m, l_sum, acc, sink):
    """Add one sink logit per row (log2 units) to the softmax denominator only."""
    m_fin = tl.maximum(m, sink)
    l_sum = l_sum * tl.exp2(m - m_fin) + tl.exp2(sink - m_fin)
    acc = acc * tl.exp2(m - m_fin)[:, None]
    return m_fin, l_sum, acc
