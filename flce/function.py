"""The public function: input checks, the custom ops (opaque to torch.compile) and autograd."""

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from flce.ops import chunked_pass
from flce.options import LossOptions

IMPLS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EMPTY = (0,)


def _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap) -> LossOptions:
    return LossOptions(ignore_index, label_smoothing, logit_scale, z_loss, softcap)


def stat_dtype(x: Tensor) -> torch.dtype:
    """Loss and lse are fp32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty(_EMPTY) if t is None else t


@torch.library.custom_op("flce::fused_forward", mutates_args=())
def fused_forward(
    x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor], loss_weight: Tensor,
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], chunk_size: Optional[int], lean: bool,
    use_triton: bool, need_dx: bool, need_dw: bool, need_db: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Loss (sum of token losses times loss_weight) and the gradients of the unweighted sum,
    left in their accumulators (fp32, or the parameter dtypes when lean)."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    lse = x.new_empty(x.shape[0], dtype=stat_dtype(x))
    # The kernel writes unweighted dlogits: their bf16 rounding then does not depend on the batch's
    # token count, and loss_weight is applied exactly, in fp32, with the upstream gradient.
    one = torch.ones((), device=x.device, dtype=lse.dtype)
    loss, dx, dw, db = chunked_pass(
        x, target, weight, bias, one, lse, False, opts, chunk_size, lean,
        use_triton, need_dx, need_dw, need_db, cast_grads=False)
    return loss.sum() * loss_weight, _or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight)


@fused_forward.register_fake
def _(x, target, weight, bias, loss_weight, ignore_index, label_smoothing, logit_scale, z_loss,
      softcap, chunk_size, lean, use_triton, need_dx, need_dw, need_db):
    acc = weight.dtype if lean else torch.promote_types(torch.float32, weight.dtype)
    return (x.new_empty((), dtype=stat_dtype(x)),
            torch.empty_like(x, dtype=x.dtype if lean else stat_dtype(x)) if need_dx
            else x.new_empty(_EMPTY),
            torch.empty_like(weight, dtype=acc) if need_dw else weight.new_empty(_EMPTY),
            torch.empty_like(bias, dtype=stat_dtype(x)) if need_db else weight.new_empty(_EMPTY))


@torch.library.custom_op("flce::token_losses", mutates_args=())
def token_losses(
    x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], chunk_size: Optional[int], use_triton: bool,
) -> Tuple[Tensor, Tensor]:
    """Per-token losses and lse, no gradients (reduction "none" forward, and evaluation)."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    lse = x.new_empty(x.shape[0], dtype=stat_dtype(x))
    one = torch.ones((), device=x.device, dtype=lse.dtype)
    loss, _, _, _ = chunked_pass(x, target, weight, bias, one, lse, False, opts, chunk_size,
                                 False, use_triton, False, False, False, cast_grads=True)
    return loss, lse


@token_losses.register_fake
def _(x, target, weight, bias, ignore_index, label_smoothing, logit_scale, z_loss, softcap,
      chunk_size, use_triton):
    n = x.shape[0]
    return x.new_empty((n,), dtype=stat_dtype(x)), x.new_empty((n,), dtype=stat_dtype(x))


@torch.library.custom_op("flce::token_losses_backward", mutates_args=())
def token_losses_backward(
    grad: Tensor, x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor], lse: Tensor,
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], chunk_size: Optional[int], lean: bool,
    use_triton: bool, need_dx: bool, need_dw: bool, need_db: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients for any per-token upstream gradient: recomputes each chunk's logits."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    _, dx, dw, db = chunked_pass(
        x, target, weight, bias, grad.to(lse.dtype), lse, True, opts, chunk_size, lean,
        use_triton, need_dx, need_dw, need_db, cast_grads=True)
    return _or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight)


@token_losses_backward.register_fake
def _(grad, x, target, weight, bias, lse, ignore_index, label_smoothing, logit_scale, z_loss,
      softcap, chunk_size, lean, use_triton, need_dx, need_dw, need_db):
    return (torch.empty_like(x) if need_dx else x.new_empty(_EMPTY),
            torch.empty_like(weight) if need_dw else weight.new_empty(_EMPTY),
            torch.empty_like(bias) if need_db else weight.new_empty(_EMPTY))


class _ReducedLoss(torch.autograd.Function):
    """mean / sum / normalizer: gradients come out of forward; backward scales and casts them."""

    @staticmethod
    def forward(ctx, x, target, weight, bias, loss_weight, config):
        need = ctx.needs_input_grad
        loss, dx, dw, db = fused_forward(
            x, target, weight, bias, loss_weight, *config, need[0], need[2], need[3])
        ctx.save_for_backward(dx, dw, db, loss_weight)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        dx, dw, db, loss_weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        x_dtype, w_dtype = ctx.dtypes
        grad = grad * loss_weight
        return (_scale_to(dx, grad, x_dtype) if need[0] else None, None,
                _scale_to(dw, grad, w_dtype) if need[2] else None,
                _scale_to(db, grad, w_dtype) if need[3] else None, None, None)


def _scale_to(acc: Tensor, grad: Tensor, dtype: torch.dtype) -> Tensor:
    """acc * grad computed in acc's precision and rounded once to dtype (in place if same)."""
    if acc.dtype == dtype:
        scale_(acc, grad)
        return acc
    return scale_cast(acc, grad, dtype)


def _fast_scale(t: Tensor) -> bool:
    return t.is_cuda and triton_usable(t.device)


@torch.library.custom_op("flce::scale_cast", mutates_args=())
def scale_cast(src: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    dst = torch.empty_like(src, dtype=dtype)
    if _fast_scale(src):
        from flce.kernels import scale_cast as triton_scale_cast
        return triton_scale_cast(src, dst, scale)
    return torch.mul(src, scale, out=dst)


@scale_cast.register_fake
def _(src, scale, dtype):
    return torch.empty_like(src, dtype=dtype)


@torch.library.custom_op("flce::scale_", mutates_args=("t",))
def scale_(t: Tensor, scale: Tensor) -> None:
    if _fast_scale(t):
        from flce.kernels import scale_cast as triton_scale_cast
        triton_scale_cast(t, t, scale)
    else:
        t.mul_(scale)


@scale_.register_fake
def _(t, scale):
    return None


class _TokenLosses(torch.autograd.Function):
    """reduction "none": per-token losses; backward recomputes with the per-token gradient."""

    @staticmethod
    def forward(ctx, x, target, weight, bias, opts, chunk_size, lean, use_triton):
        loss, lse = token_losses(x, target, weight, bias, *opts, chunk_size, use_triton)
        ctx.save_for_backward(x, target, weight, bias, lse)
        ctx.config = (opts, chunk_size, lean, use_triton)
        return loss

    @staticmethod
    def backward(ctx, grad):
        x, target, weight, bias, lse = ctx.saved_tensors
        need = ctx.needs_input_grad
        opts, chunk_size, lean, use_triton = ctx.config
        dx, dw, db = token_losses_backward(
            grad, x, target, weight, bias, lse, *opts, chunk_size, lean, use_triton,
            need[0], need[2], need[3])
        return (dx if need[0] else None, None, dw if need[2] else None,
                db if need[3] else None, None, None, None, None)


def _check_inputs(x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [N, H] or [B, T, H], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [V, H={x.shape[-1]}] to match x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal x.shape[:-1] = "
                         f"{tuple(x.shape[:-1])}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"target must hold integer class ids, got dtype {target.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V={weight.shape[0]}], got {tuple(bias.shape)}")
    named = [("x", x), ("target", target), ("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    devices = {name: t.device for name, t in named}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    for name, t in named[2:]:
        if t.dtype != x.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from x dtype {x.dtype}")


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _use_triton(impl: str, x: Tensor) -> bool:
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


def _loss_weight(target: Tensor, opts: LossOptions, normalizer, device, dtype) -> Tensor:
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


def fused_linear_cross_entropy(
    x: Tensor,
    target: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    normalizer=None,
    chunk_size: Optional[int] = None,
    memory_lean: bool = False,
    impl: str = "auto",
) -> Tensor:
    """cross_entropy(softcap(logit_scale * (x @ weight.T + bias)), target) without the logits.

    See README.md for the exact loss; `normalizer` (tensor or number) replaces the divisor of
    "mean"/"sum" (e.g. the global count of non-ignored tokens across micro-batches and ranks).
    `memory_lean=True` accumulates dW in the weight dtype over small chunks: the peak memory of
    Liger-Kernel (gradients + a logits buffer the size of x) and its bf16 accumulation error.
    """
    opts = LossOptions(ignore_index, label_smoothing, logit_scale, z_loss, softcap, reduction)
    _check_inputs(x, target, weight, bias)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: must be None or a positive int")
    if not isinstance(memory_lean, bool):
        raise TypeError(f"memory_lean={memory_lean!r}: must be a bool")
    if normalizer is not None and reduction == "none":
        raise ValueError("normalizer applies to reduction='mean' or 'sum', not 'none'")
    use_triton = _use_triton(impl, x)
    x2, t2 = x.reshape(-1, x.shape[-1]), target.reshape(-1)
    o = (ignore_index, float(label_smoothing), float(logit_scale), float(z_loss),
         None if softcap is None else float(softcap))
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    if reduction == "none":
        if not grad:
            return token_losses(x2, t2, weight, bias, *o, chunk_size, use_triton)[0].reshape(target.shape)
        loss = _TokenLosses.apply(x2, t2, weight, bias, o, chunk_size, memory_lean, use_triton)
        return loss.reshape(target.shape)
    loss_weight = _loss_weight(t2, opts, normalizer, x.device, stat_dtype(x))
    config = o + (chunk_size, memory_lean, use_triton)
    if not grad:
        return fused_forward(x2, t2, weight, bias, loss_weight, *config, False, False, False)[0]
    return _ReducedLoss.apply(x2, t2, weight, bias, loss_weight, config)
