"""The loss in plain PyTorch: the live CPU path's row math, and the two unfused baselines.

Not only a reference. `chunk_rows` is the PyTorch twin of `kernels.flce_rows_kernel` (same
inputs, same outputs, same fp32 math): the chunk loop in `ops.py` runs it whenever Triton does
not (CPU tensors, impl="torch"), so it is what `flce.fused_linear_cross_entropy` computes on a
CPU. `scaled_logits` and `per_token_loss` are the per-token math it shares with the
vocab-parallel loss (`vocab_parallel.py`); `reduce_loss` applies a reduction.

The baselines the fused loss is compared against: `linear_cross_entropy` (the unfused loss:
full logits, fp32 loss, autograd) and `chunked_linear_cross_entropy` (the same per chunk of
tokens, each chunk's logits recomputed in backward).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from flce.options import LossOptions


def scaled_logits(a: Tensor, opts: LossOptions) -> Tensor:
    """z = softcap(logit_scale * a), in fp32 (float64 stays float64)."""
    z = a.to(torch.promote_types(a.dtype, torch.float32)) * opts.logit_scale
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    return z


def per_token_loss(z: Tensor, target: Tensor, shift: Tensor, log_s: Tensor,
                   opts: LossOptions) -> Tensor:
    """Loss per row of fp32 logits z [N, V] with lse = shift + log_s; rows whose target is
    ignore_index get 0. Differences are taken against shift (the row max) before log_s is
    added: with logits ~1e4 an fp32 lse has an ulp of ~1e-3, z - shift is exact."""
    keep = target != opts.ignore_index
    y = torch.where(keep, target, torch.zeros_like(target))
    loss = log_s - (z.gather(1, y[:, None]).squeeze(1) - shift)
    if opts.label_smoothing:
        loss = (1 - opts.label_smoothing) * loss + opts.label_smoothing * (log_s - (z.mean(1) - shift))
    if opts.z_loss:
        lse = shift + log_s
        loss = loss + opts.z_loss * lse * lse
    return torch.where(keep, loss, torch.zeros_like(loss))


def check_targets(target: Tensor, opts: LossOptions, vocab: int) -> None:
    """Raise on a target outside [0, vocab) that is not ignore_index. The PyTorch path's check
    (a host check costs nothing on the CPU); the Triton kernels make such a row's loss NaN."""
    bad = (target != opts.ignore_index) & ((target < 0) | (target >= vocab))
    if bad.any():
        raise IndexError(f"target id {int(target[bad][0])} is outside [0, {vocab}) "
                         f"and is not ignore_index={opts.ignore_index}")


def row_max_and_log_sum(z: Tensor) -> tuple[Tensor, Tensor]:
    """(max, log sum exp(z - max)) per row: lse = max + log_sum, kept apart for precision."""
    m = z.max(dim=1).values
    return m, torch.logsumexp(z - m[:, None], dim=1)


def chunk_rows(logits: Tensor, target: Tensor, loss_out: Tensor,
               stats: Optional[tuple[Tensor, Tensor]], weight: Tensor, opts: LossOptions,
               stats_given: bool, compute_grad: bool,
               fp8_grad: Optional[tuple[Tensor, Tensor, Tensor]] = None,
               off_max: Optional[Tensor] = None, weight_scale: Optional[Tensor] = None,
               width: Optional[int] = None) -> None:
    """Fill loss_out for a chunk and, if compute_grad, overwrite logits with dlogits.

    stats: (row max of z, log sum exp(z - max)), written, or read when stats_given (a gradient
    pass after a statistics pass, which writes no loss); None when nobody needs them. They are
    kept apart rather than as lse: at logits ~1e4 an fp32 lse is ~1e-3 off, and exp(z - lse)
    with it; z - max is exact.

    weight is the fp32 gradient weight per row ([C]) or for all rows (a 0-dim tensor), times
    weight_scale (a 0-dim fp32 tensor) when given.
    Targets outside [0, V) raise (an index error from gather) rather than read garbage.
    fp8_grad = (g8, g8_scale, target_grad), filled for the float8 dx GEMM: dlogits / g8_scale
    in float8 with the target column 0, the row scale (a bound on |dlogits| off the target,
    from the statistics, over the float8 maximum) and dlogits in the target column, in fp32.
    off_max: a statistics pass (not compute_grad) writes each row's largest z off the target
    there (0 for ignored rows), which a later float8 gradient pass of the Triton kernel reads;
    this twin recomputes it from z.
    width: the Triton kernel's access width (`kernels.launch_rows`); the padding it may zero is
    left as it is here, where nothing is gained by touching it.
    """
    V = logits.shape[1]
    if weight_scale is not None:
        weight = weight * weight_scale
    z = scaled_logits(logits, opts)
    keep = target != opts.ignore_index
    check_targets(target, opts, V)
    if stats_given:  # a gradient pass: the caller has the loss
        shift, log_s = stats
    else:
        shift, log_s = row_max_and_log_sum(z)
        loss_out.copy_(per_token_loss(z, target, shift, log_s, opts))
        if stats is not None:
            for out, value in zip(stats, (shift, log_s)):
                out.copy_(torch.where(keep, value, torch.zeros_like(value)))
    if not compute_grad:
        if off_max is not None:
            off = _off_target(z, torch.where(keep, target, torch.zeros_like(target)))
            off_max.copy_(torch.where(keep, off.max(dim=1).values, torch.zeros_like(shift)))
        return
    ls = opts.label_smoothing
    lse = shift + log_s
    g = torch.exp(z - shift[:, None] - log_s[:, None]) * (1 + 2 * opts.z_loss * lse[:, None]) - ls / V
    y = torch.where(keep, target, torch.zeros_like(target))
    g.scatter_add_(1, y[:, None], torch.full_like(lse[:, None], -(1 - ls)))
    g *= (weight.expand(lse.shape) * opts.logit_scale)[:, None]
    if opts.softcap is not None:
        g *= 1 - (z / opts.softcap) ** 2
    g = torch.where(keep[:, None], g, torch.zeros_like(g))
    logits.copy_(g)
    if fp8_grad is not None:
        _float8_grad(g, z, y, keep, shift, log_s, weight, opts, *fp8_grad)


def _float8_grad(g: Tensor, z: Tensor, y: Tensor, keep: Tensor, shift: Tensor, log_s: Tensor,
                 weight: Tensor, opts: LossOptions, g8: Tensor, g8_scale: Tensor,
                 target_grad: Tensor) -> None:
    """The float8 outputs of chunk_rows (kernels.flce_rows_kernel: FP8_GRAD)."""
    fp8_max = torch.finfo(g8.dtype).max
    V = z.shape[1]
    is_target = torch.zeros_like(g, dtype=torch.bool).scatter_(1, y[:, None], True)
    # off the target, g_j = w s (p_j coef - uniform) softcap'_j, p_j <= p_off, |softcap'_j| <= 1
    p_off = torch.exp(_off_target(z, y).max(dim=1).values - shift - log_s)
    coef = 1 + 2 * opts.z_loss * (shift + log_s)
    uniform = opts.label_smoothing / V
    bound = (weight * opts.logit_scale).abs() * torch.maximum(
        (p_off * coef - uniform).abs(), torch.full_like(p_off, uniform))
    bound = torch.where(keep, bound, torch.zeros_like(bound))
    g8_scale.copy_(bound / fp8_max)
    inv = torch.where(bound > 0, fp8_max / bound, torch.zeros_like(bound))
    g8.copy_((g * inv[:, None]).masked_fill(is_target, 0).clamp(-fp8_max, fp8_max))
    target_grad.copy_(g.gather(1, y[:, None]).squeeze(1))


def _off_target(z: Tensor, y: Tensor) -> Tensor:
    """z with each row's target column at -inf."""
    return z.scatter(1, y[:, None], float("-inf"))


def linear_cross_entropy(
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
) -> Tensor:
    """The unfused baseline: full logits in the input dtype, the loss in fp32, plain autograd."""
    opts = LossOptions(ignore_index, label_smoothing, logit_scale, z_loss, softcap, reduction)
    shape = target.shape
    x = x.reshape(-1, x.shape[-1])
    # the class ids the fused loss takes (int8 to int64): cross_entropy takes int64 alone
    target = target.reshape(-1).long()
    z = scaled_logits(F.linear(x, weight, bias), opts)
    if opts.z_loss == 0:  # the stock loss, as most trainers call it
        loss = F.cross_entropy(z, target, ignore_index=opts.ignore_index,
                               label_smoothing=opts.label_smoothing, reduction="none")
    else:
        loss = per_token_loss(z, target, *row_max_and_log_sum(z), opts)
    return reduce_loss(loss, target, opts, normalizer, shape)


def reduce_loss(loss: Tensor, target: Tensor, opts: LossOptions, normalizer, shape) -> Tensor:
    """Per-token losses to the requested reduction; normalizer (if given) divides the sum."""
    if opts.reduction == "none":
        return loss.reshape(shape)
    total = loss.sum()
    if normalizer is not None:
        return total / normalizer
    if opts.reduction == "mean":
        return total / (target != opts.ignore_index).sum().clamp(min=1)
    return total


def chunked_linear_cross_entropy(
    x: Tensor,
    target: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    *,
    chunk_size: int = 4096,
    normalizer=None,
    reduction: str = "mean",
    **options,
) -> Tensor:
    """The unfused loss over token chunks with each chunk's logits recomputed in backward
    (activation checkpointing): the logits memory of one chunk, in plain PyTorch and autograd.
    The comparison point for a compiler-free chunked loss (8·N·H·V FLOPs)."""
    from torch.utils.checkpoint import checkpoint

    if reduction == "none":
        raise ValueError("chunked_linear_cross_entropy sums; use reduction 'mean' or 'sum'")
    opts = LossOptions(reduction=reduction, **options)
    x2, t2 = x.reshape(-1, x.shape[-1]), target.reshape(-1)

    def chunk_sum(xc, tc):
        return linear_cross_entropy(xc, tc, weight, bias, reduction="sum", **options)

    # no tokens (a tensor-parallel rank's empty sequence shard): one empty chunk, a zero loss
    # whose gradients are zeros, as the other implementations give
    total = sum(checkpoint(chunk_sum, x2[i:i + chunk_size], t2[i:i + chunk_size],
                           use_reentrant=False) for i in range(0, max(x2.shape[0], 1), chunk_size))
    return reduce_loss(total.reshape(1), t2, opts, normalizer, None).reshape(())
