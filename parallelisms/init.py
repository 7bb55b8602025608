"""Initialise a parallelised model exactly as one process would, whatever the layout."""

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def init_as_on_one_device(model: nn.Module, init_fn: Callable[[], None]) -> None:
    """Run init_fn (e.g. model.init_weights) with every sharded parameter temporarily replaced
    by a full-size tensor, then keep each rank's own slice of it.

    Every rank draws the same full tensors in the same order from the same seed, so the result
    equals a single-process init for any FSDP/TP layout: DTensor's own sharded random ops
    differ by layout, and on the CPU they are not coordinated across ranks at all. Costs one
    full parameter of memory at a time, not the full model."""
    swapped, full_of = [], {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in full_of:  # tied parameters share one full tensor
                    full_of[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device),
                        requires_grad=p.requires_grad)
                module._parameters[name] = full_of[id(p)]
                swapped.append((module, name, p))
    try:
        init_fn()
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
    done = set()
    for _, _, p in swapped:
        if id(p) not in done:
            done.add(id(p))
            local = distribute_tensor(full_of[id(p)].detach(), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()
            p.to_local().copy_(local)
