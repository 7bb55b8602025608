"""The loss over slices of the vocabulary, in PyTorch: what each slice of the logits contributes
to a row's softmax statistics, how the slices' contributions combine into the loss, and the
gradient of one slice once the row's statistics are known.

Two callers hold the logits a slice at a time: the vocab-parallel loss (`vocab_parallel.py`: one
slice per rank, combined by all-reduces) and memory_lean's vocabulary sweep (`vocab_sweep.py`:
one slice after another on one device). On CUDA the same math runs in the Triton kernels
(`kernels.launch_row_stats`, then `kernels.launch_rows` with the slice's offset); these are the
CPU path and the twins those kernels are tested against.
"""

import torch
from torch import Tensor

from flce.options import LossOptions
from flce.reference import scaled_logits


def row_max(z: Tensor) -> Tensor:
    """Each row's max; -inf for an empty vocabulary slice (fewer classes than ranks), which then
    adds nothing: its exp-sum, target logit and sum of logits are all 0."""
    if z.shape[1] == 0:
        return torch.full(z.shape[:1], float("-inf"), device=z.device, dtype=z.dtype)
    return z.max(dim=1).values


def target_logit(z: Tensor, target: Tensor, opts: LossOptions, vocab_start: int) -> Tensor:
    """z[target] where the slice starting at vocab_start holds the target, else 0 (summed over
    the slices later)."""
    if z.shape[1] == 0:
        return torch.zeros(z.shape[:1], device=z.device, dtype=z.dtype)
    y_local = target - vocab_start
    owns = (target != opts.ignore_index) & (y_local >= 0) & (y_local < z.shape[1])
    return torch.where(owns, z.gather(1, y_local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1), 0.0)


def slice_stats(logits: Tensor, target: Tensor, opts: LossOptions, vocab_start: int) -> Tensor:
    """[C, 4]: each row's (max, sum exp(z - max), target logit or 0, sum z) over this slice, as
    `kernels.flce_row_stats_kernel` writes them (rows whose target is ignore_index: 0, 1, 0, 0)."""
    z = scaled_logits(logits, opts)
    m = row_max(z)
    ignored = target == opts.ignore_index
    # a slice of -inf logits only (masked classes) has exp-sum 0 about any finite max; about its
    # own max, exp(-inf - -inf) is NaN
    finite_m = torch.where(m == float("-inf"), 0.0, m)
    return torch.stack([m.masked_fill(ignored, 0.0),
                        torch.exp(z - finite_m[:, None]).sum(1).masked_fill(ignored, 1.0),
                        target_logit(z, target, opts, vocab_start), z.sum(1).masked_fill(ignored, 0.0)],
                       dim=1)


def combine_slices(parts: Tensor) -> Tensor:
    """[k, C, 4] statistics of k slices (`slice_stats`) -> [C, 4] of their union. A part whose
    max is -inf and exp-sum 0 adds nothing (a start value)."""
    m = parts[..., 0].amax(0)
    s = (parts[..., 1] * torch.exp(parts[..., 0] - m)).sum(0)
    return torch.stack([m, s, parts[..., 2].sum(0), parts[..., 3].sum(0)], dim=1)


def loss_from_sums(m: Tensor, sums: Tensor, target: Tensor, opts: LossOptions,
                   vocab_size: int) -> tuple[Tensor, Tensor]:
    """Per-token loss and log sum exp(z - m) from the row max m over the whole vocabulary and
    the sums over it (sum exp(z - m), target logit, sum z); the loss is 0 for ignored tokens and
    NaN for a target outside [0, vocab_size). log_s is kept apart from m: see
    reference.per_token_loss."""
    log_s = torch.log(sums[0])
    ls = opts.label_smoothing
    loss = (1 - ls) * (log_s - (sums[1] - m))
    if ls:  # sum z is -inf where a class is masked by a -inf logit: 0 * -inf would be NaN
        loss = loss + ls * (log_s - (sums[2] / vocab_size - m))
    lse = m + log_s
    loss = loss + opts.z_loss * lse * lse
    keep = target != opts.ignore_index
    bad = keep & ((target < 0) | (target >= vocab_size))
    loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    return torch.where(keep, loss, 0.0), log_s


def slice_grads(logits: Tensor, target: Tensor, loss: Tensor, m: Tensor, log_s: Tensor,
                row_weight: Tensor, opts: LossOptions, vocab_start: int,
                vocab_size: int) -> None:
    """Overwrite a slice's logits with row_weight (0-dim or [C]) times the loss's gradient in
    them, from the rows' statistics over the whole vocabulary (m, log_s); label smoothing
    averages over all vocab_size classes. Rows whose loss is NaN (a bad target) get NaN: never
    silent."""
    z = scaled_logits(logits, opts)
    lse = m + log_s
    ls = opts.label_smoothing
    g = torch.exp(z - m[:, None] - log_s[:, None]) * (1 + 2 * opts.z_loss * lse[:, None]) - ls / vocab_size
    y_local = target - vocab_start
    owns = (target != opts.ignore_index) & (y_local >= 0) & (y_local < z.shape[1])
    if z.shape[1]:  # a scatter: indexing by owns.nonzero() has a data-dependent shape
        g.scatter_add_(1, y_local.clamp(0, z.shape[1] - 1)[:, None],
                       owns.to(g.dtype)[:, None] * -(1 - ls))
    g *= (row_weight.expand(m.shape) * opts.logit_scale)[:, None]
    if opts.softcap is not None:
        g *= 1 - (z / opts.softcap) ** 2
    keep = target != opts.ignore_index
    g = torch.where(keep[:, None], g, 0.0)
    g = torch.where(torch.isnan(loss)[:, None], float("nan"), g)
    logits.copy_(g)
