"""FSDP2: each transformer block, the embeddings, then the root (final norm, output and loss)."""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from parallelisms.mesh import ParallelDims


def apply_fsdp(model_with_loss: torch.nn.Module, mesh: DeviceMesh, dims: ParallelDims,
               param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: str = "default") -> None:
    """Shard over dp_shard (x cp with context parallelism; HSDP: replicate over dp_replicate too).

    The root owns the final norm and the output projection, so the loss (run inside the root's
    forward) sees the unsharded output weight, which is freed after backward. Gradients are
    summed, not averaged, across ranks: the loss is already divided by the global token count."""
    dp_mesh = dims.fsdp_mesh(mesh)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = model_with_loss.model
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # "default": the last block is needed first in backward, so keep it gathered; with
        # nothing sharded (dp_shard 1, e.g. one GPU) resharding would only drop the bf16 copy
        # and cast it again for backward, so keep every block gathered. "never" keeps every
        # block's parameters gathered until backward (more memory, less traffic).
        default = i < len(blocks) - 1 and dims.dp_shard * dims.cp > 1
        reshard = {"always": True, "never": False}.get(reshard_after_forward, default)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model_with_loss, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model_with_loss.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # a plain SUM: gloo has no PREMUL_SUM, and with a factor of 1 nothing is lost
            module.set_force_sum_reduction_for_comms(True)


def precompute_float8_scales(model: torch.nn.Module) -> None:
    """After an optimizer step, with float8 all-gather: the scales of every float8 weight from one
    all-reduce, which the next all-gathers use, instead of one small all-reduce of each weight's
    max |w| at each all-gather (torchao's precompute_float8_dynamic_scale_for_fsdp)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    precompute_float8_dynamic_scale_for_fsdp(model)
