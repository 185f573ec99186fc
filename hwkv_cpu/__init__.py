"""hwkv's CPU device: vectorized torch kernels, sgl-kernel CPU ops when importable, torch.compile graphs."""
from hwkv_cpu.device import DEVICE

__all__ = ["DEVICE"]
