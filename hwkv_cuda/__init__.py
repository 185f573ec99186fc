"""hwkv's CUDA device: Triton kernels, TritonBackend, CUDA graphs (and the MUSA variant in hwkv_cuda.musa)."""
from hwkv_cuda.device import DEVICE

__all__ = ["DEVICE"]
