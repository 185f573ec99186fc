"""Test-wide settings: Triton runs in its interpreter when no GPU is present (CPU CI)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
