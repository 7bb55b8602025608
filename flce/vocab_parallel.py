"""The fused loss with the output weight sharded on the vocabulary across a process group.

Per chunk of tokens, each rank computes the logits of its vocabulary slice; the row maximum, the
sum of exponentials, the target logit and the sum of logits are combined with two all-reduces
(MAX, then one SUM of three values), so every rank knows the global lse and loss without the
weight or the full logits ever being gathered. The gradient of the slice follows as in the
single-device loss: dW of the slice stays local, dx is a partial sum over the vocabulary slices
(the caller sums it across ranks), and label smoothing averages over the full vocabulary.

On CUDA the row math runs in the Triton kernels (a statistics pass, then the single-device
gradient kernel with a vocabulary offset); the PyTorch version is the CPU path and the reference.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from flce.custom_ops import scale_to
from flce.dispatch import (check_inputs, loss_weight, outside_autocast, refuse_double_backward,
                           stat_dtype, use_triton, widened)
from flce.ops import chunk_loop, pick_chunk_size, unpadded, weight_grad_buffer
from flce.options import LossOptions
from flce.reference import scaled_logits
from flce.vocab_slices import loss_from_sums, row_max, slice_grads, target_logit


def _check_slice(weight: Tensor, vocab_start: int, vocab_size: int) -> None:
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: the loss needs at least one class")
    rows = weight.shape[0]  # an empty slice may start past the end (torch.chunk's cut)
    if rows and not (0 <= vocab_start and vocab_start + rows <= vocab_size):
        raise ValueError(f"weight {tuple(weight.shape)} from row vocab_start={vocab_start} is not "
                         f"a slice of a vocabulary of {vocab_size}")


def _chunk_grads(logits: Tensor, target: Tensor, opts: LossOptions, vocab_start: int,
                 vocab_size: int, group, width: int) -> Tensor:
    """Per-token losses (the same on every rank) and dlogits of this rank's slice, in place
    (width, the Triton twin's access width, is of no use here)."""
    z = scaled_logits(logits, opts)
    m = row_max(z)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([torch.exp(z - m[:, None]).sum(1),
                        target_logit(z, target, opts, vocab_start), z.sum(1)])
    dist.all_reduce(sums, group=group)
    loss, log_s = loss_from_sums(m, sums, target, opts, vocab_size)
    one = torch.ones((), device=logits.device, dtype=z.dtype)
    slice_grads(logits, target, loss, m, log_s, one, opts, vocab_start, vocab_size)
    return loss


def _combine(stats: Tensor, target: Tensor, opts: LossOptions, vocab_size: int, group):
    """Per-token loss and the global (row max, log sum exp(z - max)) from every rank's (max,
    sum-exp, target logit, sum z)."""
    m = stats[:, 0].clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([stats[:, 1] * torch.exp(stats[:, 0] - m), stats[:, 2], stats[:, 3]])
    dist.all_reduce(sums, group=group)
    loss, log_s = loss_from_sums(m, sums, target, opts, vocab_size)
    return loss, (m, log_s)


def _chunk_grads_triton(logits: Tensor, target: Tensor, opts: LossOptions, vocab_start: int,
                        vocab_size: int, group, width: int) -> Tensor:
    """The Triton twin of _chunk_grads: a stats pass, two all-reduces, a gradient pass."""
    from flce.kernels import launch_row_stats, launch_rows

    C = logits.shape[0]
    stats = torch.empty(C, 4, device=logits.device, dtype=torch.float32)
    launch_row_stats(logits, target, stats, opts, vocab_start, width=width)
    loss, row_stats = _combine(stats, target, opts, vocab_size, group)
    one = torch.ones((), device=logits.device, dtype=torch.float32)
    # a gradient pass writes no loss: its loss_out (the row maxima) is left as it is
    launch_rows(logits, target, row_stats[0], row_stats, one, opts, True, True,
                vocab_start=vocab_start, vocab_total=vocab_size, width=width)
    return loss


class _VocabParallelLoss(torch.autograd.Function):
    """Gradients formed in forward by the single-device chunk loop (ops.chunk_loop) over this
    rank's vocabulary slice; backward scales them by the upstream gradient and rounds once to
    the parameter dtypes."""

    @staticmethod
    def forward(ctx, x, target, weight, bias, loss_weight, opts, vocab_start, vocab_size, group,
                chunk_size, use_triton):
        N, H = x.shape
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_db = bias is not None and ctx.needs_input_grad[3]
        acc = torch.promote_types(torch.float32, weight.dtype)
        dx = torch.empty(N, H, device=x.device, dtype=acc) if need_dx else None
        dw = weight_grad_buffer(weight, acc, N) if need_dw else None
        db = torch.zeros(weight.shape[0], device=x.device, dtype=acc) if need_db else None
        losses = torch.zeros(N, device=x.device, dtype=acc)
        # an empty slice (fewer classes than ranks) only takes part in the all-reduces: the
        # PyTorch rows do that with no kernel launch over zero columns
        rows = _chunk_grads_triton if use_triton and weight.shape[0] else _chunk_grads

        def row_pass(logits, start, end, width):
            losses[start:end] = rows(logits, target[start:end], opts, vocab_start, vocab_size,
                                     group, width)

        # every rank must run as many chunks (each chunk is two all-reduces): size them by the
        # largest slice, not this rank's, which is shorter (or empty) at the end of the vocabulary
        largest_slice = -(-vocab_size // dist.get_world_size(group))
        C = pick_chunk_size(N, H, largest_slice, x.element_size(), chunk_size, lean=False)
        chunk_loop(x, weight, bias, C, row_pass, dx, dw, db)
        dw = unpadded(dw, weight.shape[0])
        total = losses.sum()
        ctx.save_for_backward(dx, dw, db, loss_weight)
        ctx.dtypes = (x.dtype, weight.dtype)
        return total * loss_weight

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward()
        dx, dw, db, loss_weight = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        scale = grad * loss_weight
        cast = lambda t, dtype: None if t is None else scale_to(t, scale, dtype)
        return (cast(dx, x_dtype), None, cast(dw, w_dtype), cast(db, w_dtype), None, None, None,
                None, None, None, None)


@outside_autocast
def vocab_parallel_linear_cross_entropy(
    x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
    vocab_start: int, vocab_size: int, group=None, opts: LossOptions = LossOptions(),
    normalizer=None, chunk_size: Optional[int] = None, impl: str = "auto",
) -> Tensor:
    """Sum of token losses / normalizer (or the mean over non-ignored tokens), identical on
    every rank of `group`; `weight` is this rank's rows [vocab_start, vocab_start + V_local).
    opts: the loss options (reduction "mean" or "sum")."""
    if opts.reduction == "none":
        raise ValueError("the vocab-parallel loss supports reduction 'mean' or 'sum'")
    check_inputs(x, target, weight, bias, empty_weight=True)
    _check_slice(weight, vocab_start, vocab_size)
    x2, t2 = x.reshape(-1, x.shape[-1]), widened(target.reshape(-1), opts.ignore_index)
    weight_of_sum = loss_weight(t2, opts, normalizer, x.device, stat_dtype(x))
    return _VocabParallelLoss.apply(x2, t2, weight, bias, weight_of_sum.reshape(()), opts,
                                    vocab_start, vocab_size, group, chunk_size,
                                    use_triton(impl, x2))


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity: every rank goes on to compute the same
    global loss, so the gradient of its own summand is the gradient of the sum (an all-reduce in
    backward, as torch.distributed.nn does, would count it once per rank)."""

    @staticmethod
    def forward(ctx, t, group):
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_linear_cross_entropy_unfused(
    x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
    vocab_start: int, vocab_size: int, group=None, opts: LossOptions = LossOptions(),
    normalizer=None,
) -> Tensor:
    """The unfused baseline of vocab_parallel_linear_cross_entropy (Megatron's vocab-parallel
    cross-entropy): this rank's [N, V / TP] logits materialised in fp32, the same statistics
    combined over the ranks, gradients by autograd."""
    if opts.reduction == "none":
        raise ValueError("the vocab-parallel loss supports reduction 'mean' or 'sum'")
    check_inputs(x, target, weight, bias, empty_weight=True)
    _check_slice(weight, vocab_start, vocab_size)
    x2, t2 = x.reshape(-1, x.shape[-1]), widened(target.reshape(-1), opts.ignore_index)
    stat = stat_dtype(x)
    z = scaled_logits(torch.nn.functional.linear(x2, weight, bias).to(stat), opts)
    m = row_max(z.detach())  # a shift: lse does not depend on it
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sums = _SumOverRanks.apply(torch.stack([torch.exp(z - m[:, None]).sum(1),
                                            target_logit(z, t2, opts, vocab_start), z.sum(1)]),
                               group)
    loss, _ = loss_from_sums(m, sums, t2, opts, vocab_size)
    return loss.sum() * loss_weight(t2, opts, normalizer, x.device, stat).reshape(())
