"""The public function: input checks and the autograd wiring."""

from typing import Optional

import torch
from torch import Tensor

from flce.custom_ops import (block_backward, block_forward, fused_forward, scale_to,
                              sweep_backward, sweep_forward, token_losses, token_losses_backward,
                              weighted_sum)
from flce.dispatch import (IMPLS, check_inputs, divisor_of, loss_weight, outside_autocast,
                           refuse_double_backward, stat_dtype, use_triton, widened)
from flce.float8 import FLOAT8
from flce.ops import float8_gemms, float8_used, uses_one_block
from flce.options import LossOptions
from flce.vocab_sweep import uses_vocab_sweep


class _OneBlockLoss(torch.autograd.Function):
    """The one-block path (`ops.py`): forward keeps the logits; backward forms the gradients
    with the upstream gradient (times the loss weight) folded into dlogits. reduce: the loss is
    the sum of the token losses over the divisor that (normalizer, inv_divisor) describe
    (`dispatch.divisor_of`), else the per-token losses (reduction "none")."""

    @staticmethod
    def forward(ctx, x, target, weight, bias, normalizer, opts, float8, use_triton, reduce,
                inv_divisor):
        need = ctx.needs_input_grad
        loss, row_max, log_sum, logits, off_max, w_col_absmax = block_forward(
            x, target, weight, bias, *opts, float8, use_triton,
            float8_gemms(float8, need[0]) == "logits+dx")
        loss_weight = None
        if reduce:
            loss, loss_weight = weighted_sum(loss, target, normalizer, inv_divisor, opts[0],
                                             use_triton)
        ctx.save_for_backward(x, target, weight, bias, row_max, log_sum, logits, off_max,
                              w_col_absmax, loss_weight)
        ctx.config = (opts, float8, use_triton)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()
        (x, target, weight, bias, row_max, log_sum, logits, off_max, w_col_absmax,
         loss_weight) = ctx.saved_tensors
        opts, float8, use_triton = ctx.config
        need = ctx.needs_input_grad
        # Eager mode frees the row statistics and the loss weight before the GEMMs; a compiled
        # graph frees its buffers at their last use itself and may reuse them, so it must not.
        dx, dw, db = block_backward(logits, grad.to(row_max.dtype), loss_weight, x, target,
                                    weight, bias, row_max, log_sum, off_max, w_col_absmax, *opts,
                                    float8, use_triton, need[0], need[2], need[3],
                                    not torch.compiler.is_compiling())
        torch.autograd.graph.increment_version(logits)  # it holds dlogits now (custom_ops.py)
        return (dx if need[0] else None, None, dw if need[2] else None,
                db if need[3] else None, None, None, None, None, None, None)


class _VocabSweepLoss(torch.autograd.Function):
    """reduction "none" by memory_lean's sweep over vocabulary slices (`vocab_sweep.py`; mean and
    sum take it inside _ReducedLoss): forward keeps each row's statistics, backward recomputes
    the slices' logits with the per-token upstream gradient folded into dlogits."""

    @staticmethod
    def forward(ctx, x, target, weight, bias, opts, use_triton):
        loss, row_max, log_sum = sweep_forward(x, target, weight, bias, *opts, use_triton)
        ctx.save_for_backward(x, target, weight, bias, loss, row_max, log_sum)
        ctx.config = (opts, use_triton)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()
        x, target, weight, bias, loss, row_max, log_sum = ctx.saved_tensors
        opts, use_triton = ctx.config
        need = ctx.needs_input_grad
        dx, dw, db = sweep_backward(grad.to(row_max.dtype), x, target, weight, bias, loss,
                                    row_max, log_sum, *opts, use_triton, need[0], need[2],
                                    need[3])
        return (dx if need[0] else None, None, dw if need[2] else None,
                db if need[3] else None, None, None)


class _ReducedLoss(torch.autograd.Function):
    """mean / sum / normalizer: gradients come out of forward; backward scales and casts them."""

    @staticmethod
    def forward(ctx, x, target, weight, bias, loss_weight, opts, chunk_size, lean, float8,
                use_triton):
        need = ctx.needs_input_grad
        loss, dx, dw, db = fused_forward(x, target, weight, bias, loss_weight, *opts, chunk_size,
                                         lean, float8, use_triton, need[0], need[2], need[3])
        ctx.save_for_backward(dx, dw, db, loss_weight)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.lean = lean  # loss_weight is already in the lean gradients (custom_ops.fused_forward)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()
        dx, dw, db, loss_weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        x_dtype, w_dtype = ctx.dtypes
        if not ctx.lean:
            grad = grad * loss_weight
        return (scale_to(dx, grad, x_dtype) if need[0] else None, None,
                scale_to(dw, grad, w_dtype) if need[2] else None,
                scale_to(db, grad, w_dtype) if need[3] else None, None, None, None, None, None,
                None)


class _TokenLosses(torch.autograd.Function):
    """reduction "none": per-token losses; backward recomputes with the per-token gradient."""

    @staticmethod
    def forward(ctx, x, target, weight, bias, opts, chunk_size, lean, float8, use_triton):
        loss, row_max, log_sum = token_losses(x, target, weight, bias, *opts, chunk_size, float8,
                                              use_triton, True)
        ctx.save_for_backward(x, target, weight, bias, row_max, log_sum)
        ctx.config = (opts, chunk_size, lean, float8, use_triton)
        return loss

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()
        x, target, weight, bias, row_max, log_sum = ctx.saved_tensors
        need = ctx.needs_input_grad
        opts, chunk_size, lean, float8, use_triton = ctx.config
        dx, dw, db = token_losses_backward(
            grad, x, target, weight, bias, row_max, log_sum, *opts, chunk_size, lean, float8,
            use_triton, need[0], need[2], need[3])
        return (dx if need[0] else None, None, dw if need[2] else None,
                db if need[3] else None, None, None, None, None, None)


def check_settings(chunk_size: Optional[int], memory_lean: bool, float8: str, impl: str) -> None:
    """The settings besides the loss's own options (LossOptions): checked by the function at
    each call and by the module once, at construction."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: must be None or a positive int")
    if not isinstance(memory_lean, bool):
        raise TypeError(f"memory_lean={memory_lean!r}: must be a bool")
    if float8 not in FLOAT8:
        raise ValueError(f"float8={float8!r}: expected one of {FLOAT8}")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")


@outside_autocast
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
    float8: str = "none",
    impl: str = "auto",
) -> Tensor:
    """cross_entropy(softcap(logit_scale * (x @ weight.T + bias)), target) without the logits.

    See docs/loss.md for the exact loss; `normalizer` (tensor or number) replaces the divisor of
    "mean"/"sum" (e.g. the global count of non-ignored tokens across micro-batches and ranks).
    `memory_lean=True` accumulates dW in the weight dtype over small chunks: the peak memory of
    Liger-Kernel (gradients + a logits buffer the size of x) and its bf16 accumulation error.
    `float8` = "logits" runs the logits GEMM in float8 (e4m3, rowwise scales), "logits+dx" the
    dx GEMM too; softmax statistics and gradients stay fp32, dW stays bf16 (see flce/float8.py).
    """
    opts = LossOptions(ignore_index, label_smoothing, logit_scale, z_loss, softcap, reduction)
    check_inputs(x, target, weight, bias)
    check_settings(chunk_size, memory_lean, float8, impl)
    if normalizer is not None and reduction == "none":
        raise ValueError("normalizer applies to reduction='mean' or 'sum', not 'none'")
    on_triton = use_triton(impl, x)
    # no reshape of what already has its shape: each is an autograd node and a launch's worth
    # of host time, which is most of the loss's time at a few thousand tokens
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    t2 = widened(target if target.dim() == 1 else target.reshape(-1), ignore_index)
    o = (ignore_index, float(label_smoothing), float(logit_scale), float(z_loss),
         None if softcap is None else float(softcap))
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))
    (N, H), V = x2.shape, weight.shape[0]
    float8 = float8_used(float8, N, H, V)
    if grad and reduction == "none" and uses_vocab_sweep(N, H, V, x.element_size(), chunk_size,
                                                         memory_lean, float8):
        return _VocabSweepLoss.apply(x2, t2, weight, bias, o, on_triton).reshape(target.shape)
    if grad and uses_one_block(N, H, V, x.element_size(), chunk_size, memory_lean):
        if reduction == "none":
            loss = _OneBlockLoss.apply(x2, t2, weight, bias, None, o, float8, on_triton, False,
                                       None)
            return loss.reshape(target.shape)
        normalizer_t, inv_divisor = divisor_of(normalizer, opts)
        return _OneBlockLoss.apply(x2, t2, weight, bias, normalizer_t, o, float8, on_triton, True,
                                   inv_divisor)
    if reduction == "none":
        if not grad:
            return token_losses(x2, t2, weight, bias, *o, chunk_size, float8, on_triton,
                                False)[0].reshape(target.shape)
        loss = _TokenLosses.apply(x2, t2, weight, bias, o, chunk_size, memory_lean, float8,
                                  on_triton)
        return loss.reshape(target.shape)
    weight_of_sum = loss_weight(t2, opts, normalizer, x.device, stat_dtype(x))
    config = (chunk_size, memory_lean, float8, on_triton)
    if not grad:
        return fused_forward(x2, t2, weight, bias, weight_of_sum, *o, *config, False, False,
                             False)[0]
    return _ReducedLoss.apply(x2, t2, weight, bias, weight_of_sum, o, *config)
