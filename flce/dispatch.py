"""How a call of the loss is carried out, shared by the entry points (function.py, the
vocab-parallel loss) and the custom ops: which implementation runs (Triton or PyTorch), the dtype
of the per-token statistics, and the weight the summed loss is multiplied by."""

import os
from typing import Optional

import torch
from torch import Tensor

from flce.options import LossOptions

IMPLS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(impl: str, x: Tensor) -> bool:
    """Whether `impl` runs the Triton kernels for x ("auto": on CUDA, in a dtype they take)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "torch":
        return False
    if impl == "triton":
        if x.dtype not in TRITON_DTYPES:
            raise TypeError(f"impl='triton' supports {TRITON_DTYPES}, got {x.dtype}; use impl='torch'")
        if not triton_usable(x.device):
            raise RuntimeError(f"impl='triton' needs triton and CUDA tensors (x is on {x.device}); "
                               "on the CPU set TRITON_INTERPRET=1 or use impl='torch'")
        return True
    return x.device.type == "cuda" and x.dtype in TRITON_DTYPES and triton_usable(x.device)


def stat_dtype(x: Tensor) -> torch.dtype:
    """Loss and lse are fp32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def loss_weight(target: Tensor, opts: LossOptions, normalizer: Optional[object], device,
                dtype) -> Tensor:
    """1 / (what the summed loss is divided by), as a device tensor (no host sync)."""
    if normalizer is not None:
        if isinstance(normalizer, Tensor):
            if normalizer.numel() != 1:
                raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
            return 1.0 / normalizer.to(device=device, dtype=dtype).reshape(())
        if not normalizer > 0:
            raise ValueError(f"normalizer={normalizer}: must be > 0")
        return torch.full((), 1.0 / float(normalizer), device=device, dtype=dtype)
    if opts.reduction == "mean":
        count = (target != opts.ignore_index).sum().clamp(min=1)
        return 1.0 / count.to(dtype)
    return torch.ones((), device=device, dtype=dtype)
