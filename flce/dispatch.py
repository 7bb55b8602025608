"""How a call of the loss is carried out, shared by the entry points (function.py, the
vocab-parallel loss) and the custom ops: which implementation runs (Triton or PyTorch), the dtype
of the per-token statistics, and the weight the summed loss is multiplied by."""

import functools
import numbers
import os
from typing import Optional

import torch
from torch import Tensor

from flce.options import LossOptions, finite

IMPLS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AUTOCAST_CASTS = (torch.float32, torch.bfloat16, torch.float16)  # what autocast casts (not fp64)


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


def outside_autocast(loss_fn):
    """A loss entry point that takes torch.autocast as nn.Linear does: under autocast its fp32,
    fp16 and bf16 inputs are cast to autocast's dtype (float64 ones are left, as autocast leaves
    them), and autocast is off inside. Left on inside, it cast the one-block path's forward GEMM
    alone (fp32 inputs got bf16 logits) and that path's backward then failed on a bf16 and an
    fp32 operand; the chunks' GEMMs write with out=, which autocast leaves alone."""
    @functools.wraps(loss_fn)
    def call(x, target, weight, bias=None, **options):
        device = x.device.type
        # is_autocast_enabled raises for a device autocast does not know (meta); a compiled
        # call's device is one it knows, and torch 2.11's dynamo cannot trace the availability
        # check (a graph break, an error under fullgraph)
        known = torch.compiler.is_compiling() or torch.amp.is_autocast_available(device)
        if not (known and torch.is_autocast_enabled(device)):
            return loss_fn(x, target, weight, bias, **options)
        dtype = torch.get_autocast_dtype(device)
        cast = lambda t: t.to(dtype) if t is not None and t.dtype in AUTOCAST_CASTS else t
        with torch.autocast(device, enabled=False):
            return loss_fn(cast(x), target, cast(weight), cast(bias), **options)
    return call


def widened(target: Tensor, ignore_index: int) -> Tensor:
    """Class ids as int32 or int64: the PyTorch path gathers with them, and gather takes no
    narrower index (int8/uint8/int16 targets failed there with a bare gather error). int32 ids
    become int64 when ignore_index lies outside int32: compared in int32, torch wraps it
    (2**32 matched class 0, whose tokens were then ignored)."""
    if target.dtype == torch.int64 or (
            target.dtype == torch.int32 and -2**31 <= ignore_index < 2**31):
        return target
    return target.long()


def refuse_double_backward() -> None:
    """Called first in the loss's backward: it returns gradients formed without a graph, so
    under create_graph=True (grad mode on in backward) every second-order term through the loss
    would be silently missing, e.g. a gradient penalty's."""
    if torch.is_grad_enabled():
        raise RuntimeError("flce: double backward (create_graph=True) is not supported: the "
                           "loss's gradients carry no graph of their own")


def stat_dtype(x: Tensor) -> torch.dtype:
    """Loss and lse are fp32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def divisor_of(normalizer: Optional[object], opts: LossOptions
               ) -> tuple[Optional[Tensor], Optional[float]]:
    """What the summed loss is divided by, checked without reading a device tensor: (a scalar
    tensor, None), (None, 1 / a number) for a number or reduction "sum", or (None, None) for
    "mean": the count of non-ignored targets."""
    if normalizer is None:
        return None, (None if opts.reduction == "mean" else 1.0)
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
        if normalizer.requires_grad and torch.is_grad_enabled():
            raise ValueError("normalizer requires grad, but the loss is not differentiated by "
                             "its divisor: pass normalizer.detach()")
        return normalizer, None
    if isinstance(normalizer, bool) or not isinstance(normalizer, numbers.Real):
        raise TypeError(f"normalizer={normalizer!r}: must be a number or a scalar tensor")
    if not (finite(normalizer) and normalizer > 0):
        raise ValueError(f"normalizer={normalizer}: must be a finite number > 0")
    return None, 1.0 / float(normalizer)


def weight_of_sum(target: Tensor, normalizer: Optional[Tensor], inv_divisor: Optional[float],
                  ignore_index: int, device, dtype) -> Tensor:
    """1 / (what the summed loss is divided by, from `divisor_of`), as a device tensor (no host
    sync). A normalizer tensor that is not a finite positive number is not read on the host:
    it makes the loss and its gradients NaN, loud downstream."""
    if normalizer is not None:
        n = normalizer.to(device=device, dtype=dtype).reshape(())
        good = torch.isfinite(n) & (n > 0)
        return torch.where(good, 1.0 / n, torch.full_like(n, float("nan")))
    if inv_divisor is not None:
        return torch.full((), inv_divisor, device=device, dtype=dtype)
    count = (target != ignore_index).sum().clamp(min=1)
    return 1.0 / count.to(dtype)


def loss_weight(target: Tensor, opts: LossOptions, normalizer: Optional[object], device,
                dtype) -> Tensor:
    """1 / (what the summed loss is divided by), as a device tensor (no host sync)."""
    return weight_of_sum(target, *divisor_of(normalizer, opts), opts.ignore_index, device, dtype)


def check_inputs(x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
                 empty_weight: bool = False) -> None:
    """Shapes, dtypes and devices of a loss call's tensors, each mistake one line naming it.
    empty_weight: a vocab-parallel rank's slice may hold no rows (fewer classes than ranks)."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [N, H] or [B, T, H], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [V, H={x.shape[-1]}] to match x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if weight.shape[0] == 0 and not empty_weight:
        raise ValueError(f"weight {tuple(weight.shape)} has no rows: the loss needs at least one "
                         "class")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal x.shape[:-1] = "
                         f"{tuple(x.shape[:-1])}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"target must hold integer class ids, got dtype {target.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V={weight.shape[0]}], got {tuple(bias.shape)}")
    named = [("x", x), ("target", target), ("weight", weight)]
    named += [("bias", bias)] if bias is not None else []
    devices = {name: t.device for name, t in named}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    for name, t in named[2:]:
        if t.dtype != x.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")
