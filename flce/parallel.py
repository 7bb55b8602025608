"""Tensor-parallel styles for a loss module called as `loss(x, target, weight, bias, ...)`.

LinearLossParallel (sequence parallel): x arrives sharded on the sequence dimension, each rank
runs the loss on its own tokens with the full (replicated) output weight, and the partial sums
are added over the TP ranks. The weight's gradient is declared Partial, so the per-rank
contributions are summed (the published version called `weight.to_local()` and kept one rank's
partial gradient under a Replicate label), and the loss is divided by the global token count
rather than averaged per rank.

VocabParallelLinearLoss: the output weight is sharded on the vocabulary; x is gathered, each
rank computes its vocabulary slice's logits, and the softmax statistics are combined with
all-reduces (`vocab_parallel.py`), so the weight is never gathered. Its fused=False form is the
unfused baseline (the slice's logits materialised), so fused and unfused runs of a vocab-parallel
layout compare the loss implementations and nothing else.
"""

import dataclasses
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


def _as_local_replicated_weight(t, mesh: DeviceMesh):
    """A weight used identically on every TP rank, as a local tensor whose gradient is summed
    over the ranks (Partial) on its way back, whether it came as a DTensor or a plain tensor."""
    if t is None:
        return None
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    if tuple(t.placements) != (Replicate(),):
        raise ValueError(f"LinearLossParallel: weight/bias must be replicated on the TP mesh, got "
                         f"{t.placements}")
    return t.to_local(grad_placements=[Partial()])


def _shard_bounds(size: int, n_shards: int, index: int) -> tuple[int, int]:
    """(start, length) of shard `index` when `size` is cut into n_shards as DTensor's Shard cuts
    it (torch.chunk): ceil(size / n) each, the last ones shorter and, when size < n, empty."""
    chunk = -(-size // n_shards)
    start = min(index * chunk, size)
    return start, min(chunk, size - start)


def _global_count(target, ignore_index: int, mesh: DeviceMesh):
    count = (target != ignore_index).sum().float()
    dist.all_reduce(count, group=mesh.get_group())
    return count.clamp(min=1)


class LinearLossParallel(ParallelStyle):
    def __init__(self, seq_dim: int = 1):
        super().__init__()
        self.seq_dim = seq_dim

    def _prepare_inputs(self, mesh: DeviceMesh, module, args, kwargs):
        x, target, weight, *rest = args
        bias = rest[0] if rest else kwargs.pop("bias", None)
        if isinstance(target, DTensor):
            target = target.full_tensor()
        if isinstance(x, DTensor):
            if tuple(x.placements) != (Shard(self.seq_dim),):
                raise ValueError(f"LinearLossParallel: x must be sharded on dim {self.seq_dim}, "
                                 f"got {x.placements}")
            # on every rank, before any collective (a rank whose share alone did not match
            # raised while the others waited in the loss's all-reduce)
            if tuple(target.shape) != tuple(x.shape[:-1]):
                raise ValueError(f"LinearLossParallel: target shape {tuple(target.shape)} must "
                                 f"equal x.shape[:-1] = {tuple(x.shape[:-1])} (x's global shape)")
            x = x.to_local()
        # the global target, cut like DTensor cuts x; a rank may get no tokens (T < ranks), and
        # then contributes nothing to the loss and zeros to the weight's gradient
        module._tp_global_target_shape = target.shape  # for reduction="none"'s DTensor
        start, length = _shard_bounds(target.shape[self.seq_dim], mesh.size(),
                                     mesh.get_local_rank())
        target = target.narrow(self.seq_dim, start, length)
        opts = getattr(module, "options", None)
        normalizer = rest[1] if len(rest) > 1 else kwargs.pop("normalizer", None)
        if normalizer is None and getattr(opts, "reduction", None) == "mean":
            normalizer = _global_count(target, opts.ignore_index, mesh)
        new_args = (x, target, _as_local_replicated_weight(weight, mesh),
                    _as_local_replicated_weight(bias, mesh))
        if normalizer is not None:
            kwargs["normalizer"] = normalizer
        return new_args, kwargs

    def _prepare_output(self, mesh: DeviceMesh, module, inputs, output):
        if output.dim() > 0:  # reduction="none": per-token losses of this rank's tokens
            # from_local would take the global length to be the local one x ranks, wrong for
            # uneven shards: give it the target's
            shape = module._tp_global_target_shape
            return DTensor.from_local(output, mesh, [Shard(self.seq_dim)], run_check=False,
                                      shape=shape, stride=torch.empty(shape, device="meta").stride())
        # every rank holds a partial sum of the one global loss
        return DTensor.from_local(output, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError("LinearLossParallel needs a 1-D (tensor-parallel) mesh")
        module.register_forward_pre_hook(partial(self._prepare_inputs, device_mesh),
                                         with_kwargs=True)
        module.register_forward_hook(partial(self._prepare_output, device_mesh))
        return module


class VocabParallelLinearLoss(ParallelStyle):
    """The output weight (and bias) sharded on dim 0 (vocabulary) over the TP mesh; x gathered
    from the sequence shards; every rank returns the same global loss. fused=False runs the
    unfused baseline instead (the slice's logits materialised, autograd), for comparisons."""

    def __init__(self, seq_dim: int = 1, chunk_size: Optional[int] = None, impl: str = "auto",
                 fused: bool = True):
        super().__init__()
        self.seq_dim = seq_dim
        self.chunk_size = chunk_size
        self.impl = impl
        self.fused = fused

    def _forward(self, mesh: DeviceMesh, module, x, target, weight, bias=None, normalizer=None):
        from flce.vocab_parallel import (vocab_parallel_linear_cross_entropy,
                                         vocab_parallel_linear_cross_entropy_unfused)

        if isinstance(x, DTensor):  # all-gather the sequence; its gradient is reduce-scattered
            x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        if isinstance(target, DTensor):
            target = target.full_tensor()
        if not (isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),)):
            raise ValueError("VocabParallelLinearLoss: the output weight must be a DTensor "
                             "sharded on dim 0 over the TP mesh (see parallelisms/tp.py)")
        vocab_size = weight.shape[0]
        local = weight.to_local()
        vocab_start, _ = _shard_bounds(vocab_size, mesh.size(), mesh.get_local_rank())
        opts = module.options  # read per call: the module may swap them between calls
        if normalizer is not None:
            opts = dataclasses.replace(opts, reduction="sum")
        kwargs = dict(vocab_start=vocab_start, vocab_size=vocab_size, group=mesh.get_group(),
                      normalizer=normalizer, opts=opts)
        bias = None if bias is None else bias.to_local()
        if not self.fused:
            return vocab_parallel_linear_cross_entropy_unfused(x, target, local, bias, **kwargs)
        return vocab_parallel_linear_cross_entropy(x, target, local, bias, **kwargs,
                                                   chunk_size=self.chunk_size, impl=self.impl)

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError("VocabParallelLinearLoss needs a 1-D (tensor-parallel) mesh")
        module.forward = partial(self._forward, device_mesh, module)
        return module
