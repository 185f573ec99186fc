"""hwkv_cuda.kernels.launch: the first call goes through the JIT, later ones through the compiled launcher
with the same argument order and constexprs; a call that would specialise differently goes through the
JIT again. A fake kernel stands in for Triton's here; the GPU run compares real launches (test_triton_kernels)."""
import types

import pytest
import torch

pytest.importorskip("triton")
from hwkv_cuda.kernels import launch as L  # noqa: E402


class Param:
    def __init__(self, name, constexpr=False, default=None, has_default=False, free=False):
        self.name, self.is_constexpr, self.default, self.has_default = name, constexpr, default, has_default
        self.do_not_specialize = free


class FakeKernel:
    """Records JIT launches and launcher calls the way Triton's would receive them."""

    def __init__(self):
        self.params = [Param("x"), Param("n"), Param("scale"), Param("BLOCK", True),
                       Param("FLAG", True, default=False, has_default=True)]
        self.jit_calls, self.direct_calls = [], []

    def __getitem__(self, grid):
        def run(*args, **consts):
            self.jit_calls.append((grid, args, consts))
            return types.SimpleNamespace(run=lambda *a: self.direct_calls.append(a), function="fn",
                                         packed_metadata="meta")
        return run


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(L, "JITFunction", FakeKernel)
    monkeypatch.setattr(L, "_CONVENTION", "all")
    monkeypatch.setattr(L, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda dev: 1234)))
    return FakeKernel()


def test_later_calls_use_the_launcher_with_every_argument(fake):
    plans = {}
    x = torch.zeros(64)
    L.launch(plans, "k", fake, (4, 2), (x, 32, 0.5), dict(BLOCK=16, num_warps=4))
    assert len(fake.jit_calls) == 1 and plans["k"].direct
    L.launch(plans, "k", fake, (4, 2), (x, 48, 0.25), {})
    assert len(fake.jit_calls) == 1
    (call,) = fake.direct_calls
    assert call[:9] == (4, 2, 1, 1234, "fn", "meta", None, None, None)
    assert call[9:] == (x, 48, 0.25, 16, False)  # runtime args, then constexprs in signature order


def test_the_runtime_convention_passes_no_constexprs(fake, monkeypatch):
    monkeypatch.setattr(L, "_CONVENTION", "runtime")
    x = torch.zeros(64)
    launch = L.Launch(fake, (1,), (x, 32, 0.5), dict(BLOCK=16))
    launch(x, 64, 1.0)
    assert fake.direct_calls[0][9:] == (x, 64, 1.0)


@pytest.mark.parametrize("changed", [
    lambda x: (x[1:], 32, 0.5),                    # a pointer that is not 16-byte aligned
    lambda x: (x.to(torch.float16), 32, 0.5),      # another dtype
    lambda x: (x, 1, 0.5),                         # an int that becomes 1
    lambda x: (x, 33, 0.5),                        # ... no longer divisible by 16
    lambda x: (x, 2 ** 33, 0.5),                   # ... wider than 32 bits
    lambda x: (x, 32, 1),                          # an int where a float was
    lambda x: (x, 32.0, 0.5),                      # a float where an int was (32 == 32.0)
    lambda x: (x, 2 ** 63, 0.5),                   # unsigned 64 bits
    lambda x: (None, 32, 0.5),                     # None where a tensor was
])
def test_a_call_that_specialises_differently_goes_through_the_jit(fake, changed):
    x = torch.zeros(64)
    launch = L.Launch(fake, (1,), (x, 32, 0.5), dict(BLOCK=16))
    launch(*changed(x))
    assert len(fake.jit_calls) == 2 and not fake.direct_calls
    assert fake.jit_calls[1][2] == dict(BLOCK=16)
    launch(x, 64, 2.0)                              # the planned variant still launches directly
    assert len(fake.direct_calls) == 1


def test_unknown_conventions_and_interpreted_kernels_keep_the_jit(fake, monkeypatch):
    x = torch.zeros(64)
    monkeypatch.setattr(L, "_CONVENTION", None)
    launch = L.Launch(fake, (1,), (x, 32, 0.5), dict(BLOCK=16))
    launch(x, 32, 0.5)
    assert not launch.direct and len(fake.jit_calls) == 2
    monkeypatch.setattr(L, "_CONVENTION", "all")
    monkeypatch.setattr(L, "JITFunction", type("Other", (), {}))  # e.g. Triton's InterpretedFunction
    assert not L.Launch(fake, (1,), (x, 32, 0.5), dict(BLOCK=16)).direct


def test_ints_the_kernel_does_not_specialise_on_only_keep_their_width(fake):
    fake.params[1].do_not_specialize = True
    x = torch.zeros(64)
    launch = L.Launch(fake, (1,), (x, 33, 0.5), dict(BLOCK=16))
    launch(x, 1, 0.5)           # 1 and 16 would specialise a plain int; not this one
    launch(x, 16, 0.5)
    assert len(fake.direct_calls) == 2 and len(fake.jit_calls) == 1
    launch(x, 2 ** 40, 0.5)     # but a 64-bit value is another signature
    assert len(fake.jit_calls) == 2


def test_another_specialisation_gets_a_plan_of_its_own(fake):
    """A buffer at another alignment under the same key: the JIT once, then its own direct launches."""
    x = torch.zeros(64)
    launch = L.Launch(fake, (1,), (x, 32, 0.5), dict(BLOCK=16))
    for _ in range(3):
        launch(x[1:], 32, 0.5)
    assert len(fake.jit_calls) == 2 and len(fake.direct_calls) == 2
    assert fake.direct_calls[-1][9] is not x  # the variant launched the misaligned view
    launch(x, 32, 0.5)  # the first specialisation keeps its plan
    assert len(fake.jit_calls) == 2 and len(fake.direct_calls) == 3


class FakeLauncher:
    """Stands in for a Triton launcher: its __call__ passes on to the C `launch` the way Triton 3.6's does."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True
    arg_annotations, kernel_signature = "ann", "sig"

    def __init__(self):
        self.calls = []
        self.launch = lambda *a: self.calls.append(a)

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                 launch_exit_hook, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, global_scratch,
                    profile_scratch, self.arg_annotations, self.kernel_signature, args)


def test_the_c_launch_is_called_as_the_launchers_own_call_would():
    launcher = FakeLauncher()
    fast = L._fast_launcher(launcher)
    fast(4, 2, 1, 99, "fn", "meta", ("x", 7))
    launcher(4, 2, 1, 99, "fn", "meta", None, None, None, "x", 7)
    assert launcher.calls[0] == launcher.calls[1] == (4, 2, 1, 99, "fn", False, True, "meta", None, None, None, None,
                                                      None, "ann", "sig", ("x", 7))


def test_a_launcher_that_needs_scratch_or_an_unknown_call_keeps_its_own_call():
    launcher = FakeLauncher()
    launcher.global_scratch_size = 128
    assert L._fast_launcher(launcher) is None

    class Odd(FakeLauncher):
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, compute_something(), *args)  # noqa: F821
    assert L._fast_launcher(Odd()) is None


def test_the_installed_triton_launcher_is_understood():
    """The Triton this suite runs with: its CUDA launcher's call is read (the GPU run launches through it)."""
    from triton.backends.nvidia.driver import CudaLauncher
    assert L._launch_template(CudaLauncher) is not None


class OlderLauncher(FakeLauncher):
    """Triton 3.6's form: the kernel metadata and the launch hooks arrive at the head of *args."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


def test_the_older_launcher_form_gets_the_metadata_at_the_head_of_its_arguments():
    launcher = OlderLauncher()
    L._fast_launcher(launcher)(4, 2, 1, 99, "fn", "meta", ("x", 7))
    launcher(4, 2, 1, 99, "fn", "meta", None, None, None, "x", 7)
    assert launcher.calls[0] == launcher.calls[1] == (4, 2, 1, 99, "fn", False, True, None, None, "meta", None, None,
                                                      None, "x", 7)


class PartedKernel(FakeKernel):
    """A kernel whose parameters come as parts: a call's (q, stride), a layer's (buf, window), a forward's (lst)."""

    def __init__(self):
        super().__init__()
        self.params = [Param("q"), Param("s_q"), Param("buf"), Param("window", free=True), Param("lst"),
                       Param("BLOCK", True)]


def _parted(fake):
    q, buf, lst = torch.zeros(64), torch.zeros(64), torch.zeros(64, dtype=torch.int64)
    launch = L.Launch(fake, (1,), (q, 64, buf, 7, lst), dict(BLOCK=16), kept=((2, 4), (4, 5)))
    layer, forward = L.spec(fake, (buf, 7), 2), L.spec(fake, (lst,), 4)
    return launch, q, buf, lst, layer, forward


def test_parts_compares_the_kept_specs_and_checks_only_the_call(monkeypatch):
    fake = PartedKernel()
    monkeypatch.setattr(L, "JITFunction", PartedKernel)
    monkeypatch.setattr(L, "_CONVENTION", "all")
    monkeypatch.setattr(L, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda dev: 1234)))
    launch, q, buf, lst, layer, forward = _parted(fake)
    assert layer == ((torch.float32, True), 32)  # the window: its width only (do_not_specialize)
    q2 = torch.ones(64)
    assert launch.parts((q2, 128, buf, 9, lst), (layer, forward)) is launch
    assert fake.direct_calls[-1][9:] == (q2, 128, buf, 9, lst, 16) and len(fake.jit_calls) == 1
    # a call part that specialises otherwise (misaligned q, a stride of 1) takes a variant of its own
    for call in ((q2[1:], 128), (q2, 1)):
        used = launch.parts((*call, buf, 9, lst), (layer, forward))
        assert used is not launch and used.direct
    assert len(fake.jit_calls) == 3
    # a kept spec that differs (say, the caller's layer part was made for a half-precision buffer): the full check
    half = torch.zeros(64, dtype=torch.float16)
    used = launch.parts((q2, 128, half, 9, lst), (L.spec(fake, (half, 9), 2), forward))
    assert used is not launch and fake.jit_calls[-1][1][2] is half
    # the variant a caller kept launches directly from then on
    before = len(fake.jit_calls)
    assert used.parts((q2, 64, half, 9, lst), (L.spec(fake, (half, 9), 2), forward)) is used
    assert len(fake.jit_calls) == before and fake.direct_calls[-1][11] is half


def test_the_generated_check_tells_kinds_apart(fake):
    """The plan's check reads types as Triton does: 1 == True == 1.0, but they are three signatures."""
    x = torch.zeros(64)
    launch = L.Launch(fake, (1,), (x, 32, 0.5), dict(BLOCK=16))
    assert launch._same((x, 48, 2.0))
    for other in ((x, True, 0.5), (x, 32.0, 0.5), (x, 32, 1), (x, 32, None), ("x", 32, 0.5), (x, 2 ** 40, 0.5)):
        assert not launch._same(other), other


def test_a_kept_variant_alternating_with_its_sibling_launches_directly(monkeypatch):
    """A caller that keeps the plan that served it (decode's forward plans, public plans) and whose calls alternate
    between two specialisations (layers whose q differ in alignment): one family table, no chain of plans."""
    fake = PartedKernel()
    monkeypatch.setattr(L, "JITFunction", PartedKernel)
    monkeypatch.setattr(L, "_CONVENTION", "all")
    monkeypatch.setattr(L, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda dev: 1234)))
    base, buf, lst = torch.zeros(80), torch.zeros(64), torch.zeros(64, dtype=torch.int64)
    layer, forward = L.spec(fake, (buf, 7), 2), L.spec(fake, (lst,), 4)
    plans, kept = {}, None
    for step in range(100):
        args = (base[:64] if step % 2 == 0 else base[1:65], 64, buf, 7, lst)
        if kept is None:
            kept = L.launch(plans, "k", fake, (1,), args, dict(BLOCK=16), ((2, 4), (4, 5)))
        else:
            kept = kept.parts(args, (layer, forward))
    assert len(fake.jit_calls) == 2 and len(fake.direct_calls) == 98
    assert set(plans["k"].variants.values()) == {plans["k"], kept}


def test_on_rocm_a_plan_also_compares_whether_a_buffer_fits_32_bit_offsets(fake, monkeypatch):
    """Triton's HIP backend specialises tensors on storage <= 2 GiB (buffer ops): so do ROCm plans."""
    monkeypatch.setattr(L, "_HIP", True)
    monkeypatch.setattr(L, "_BUFFER_OPS_MAX", 256)  # 64 fp32 fit, 128 do not
    small, big = torch.zeros(64), torch.zeros(128)
    launch = L.Launch(fake, (1,), (small, 32, 0.5), dict(BLOCK=16))
    assert L.spec(fake, (small,)) != L.spec(fake, (big,))
    assert launch._same((torch.ones(64), 32, 0.5)) and not launch._same((big, 32, 0.5))


class Desc:
    """Stands in for a host-side TMA descriptor (Gluon's TensorDescriptor: a dataclass over a base tensor)."""

    def __init__(self, base, block, layout="swizzle128", padding="zero"):
        self.base, self.shape, self.strides = base, list(base.shape), list(base.stride())
        self.block_shape, self.layout, self.padding = list(block), layout, padding

    __hash__ = None   # a dataclass with eq: unhashable, as Gluon's is


def test_descriptor_arguments_launch_directly_and_specialise_on_dtype_block_and_layout(fake):
    """The Gluon kernel's q/out descriptors: a new descriptor per call (another tensor, another length, a base that is
    not the first's) launches directly; another dtype, box or layout is another signature, through the JIT once."""
    x = torch.zeros(64, 8)
    launch = L.Launch(fake, (1,), (Desc(x, [16, 8]), 32, 0.5), dict(BLOCK=16))
    assert launch.direct
    y = torch.zeros(300, 8)
    for d in (Desc(x, [16, 8]), Desc(y, (16, 8)), Desc(y[8:], [16, 8])):
        launch(d, 48, 1.0)
    assert len(fake.jit_calls) == 1 and len(fake.direct_calls) == 3
    assert fake.direct_calls[-1][9].base.data_ptr() == y[8:].data_ptr()
    for other in (Desc(x.half(), [16, 8]), Desc(x, [32, 8]), Desc(x, [16, 8], "swizzle64"),
                  Desc(x, [16, 8], padding="nan"), x):
        assert not launch._same((other, 32, 0.5)), other
    launch(Desc(x.half(), [16, 8]), 32, 0.5)     # another signature: a plan of its own, through the JIT once
    launch(Desc(y.half(), [16, 8]), 32, 0.5)
    assert len(fake.jit_calls) == 2 and len(fake.direct_calls) == 4
    assert L.spec(fake, (Desc(x, [16, 8]),)) == L.spec(fake, (Desc(y[8:], (16, 8)),))
