"""Activation checkpointing of transformer blocks: none, full, every k-th block, per op, or
what torch.compile picks within a memory budget.

`selective_ac_option = "op"` (torchtitan's per-op selective checkpointing) wraps every block but
keeps what is costly to recompute for the memory it takes: the attention's outputs, the float8
casts' absolute maxima, the sequence-parallel reduce-scatters, and every other matmul's output
(the first, third, ... of a block: of a Llama block's seven projections wq, wv, w1 and w2); the
norms, RoPE, SwiGLU's elementwise work and the other matmuls run again in backward. Matmuls are
`aten.mm` and, for float8 linear layers, `aten._scaled_mm` (torchtitan 0.2.2's list names
`aten.mm` only, so it keeps none of float8's GEMM outputs). In eager blocks (compile off) a kept
output that backward never reads, w2's, is held until the block's backward all the same: the
policy sees ops, not what reads them.

`mode = "memory_budget"` wraps nothing: the compiled blocks' partitioner keeps `memory_budget` of
their activation memory and recomputes the rest, choosing the ops whose recomputation costs
least for the memory it saves (torch._functorch.config.activation_memory_budget, the setting
torchtitan's mode of that name makes too).
"""

import typing
from collections import Counter
from functools import partial

import torch
import torch._functorch.config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from components.config.schema import ACMode

MODES = typing.get_args(ACMode)
PER_OP = "op"

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten._scaled_mm.default}
ALWAYS_SAVED = {
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    aten.max.default,  # float8's tensorwise amax: the recomputed cast reuses the forward's scale
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _per_op_policy(matmuls: Counter, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Save the ops of ALWAYS_SAVED and odd-numbered matmuls; recompute the rest. Forward and
    the recomputation count their matmuls apart, so both make the same choice for each."""
    if func in MATMULS:
        matmuls[ctx.is_recompute] += 1
        keep = matmuls[ctx.is_recompute] % 2 == 1
    else:
        keep = func in ALWAYS_SAVED
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def per_op_context():
    """A fresh policy (its own matmul counts) for each checkpointed call of a block."""
    return create_selective_checkpoint_contexts(partial(_per_op_policy, Counter()))


def check_settings(mode: str, every: str) -> None:
    """The [activation_checkpoint] mode and selective_ac_option, as config errors (ValueError)."""
    if mode not in MODES:
        raise ValueError(f"[activation_checkpoint] mode = {mode!r}: expected one of {MODES}")
    whole = every.isascii() and every.isdigit()  # str.isdigit() alone takes "²", int() not
    if mode == "selective" and every != PER_OP and (not whole or int(every) < 1):
        raise ValueError(f"[activation_checkpoint] selective_ac_option = {every!r}: expected "
                         f"{PER_OP!r} (per op) or a positive integer k (every k-th block)")


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: str = "2",
                                   memory_budget: float = 1.0) -> int:
    """Wrap blocks of model.layers in place; returns how many were wrapped. Sets the compiler's
    activation memory budget (process-wide, read when a block is compiled) to memory_budget for
    mode "memory_budget" and back to 1, keep all, for the others."""
    check_settings(mode, every)
    torch._functorch.config.activation_memory_budget = (
        memory_budget if mode == "memory_budget" else 1.0)
    # Under TP and CP the blocks' graphs hold DeviceMeshes (script objects), which the budget's
    # partitioner refuses to size unless told they weigh nothing: they hold no activations.
    if hasattr(torch._functorch.config, "unsafe_treat_script_objects_as_zero_size"):
        torch._functorch.config.unsafe_treat_script_objects_as_zero_size = mode == "memory_budget"
    if mode in ("none", "memory_budget"):
        return 0
    k, options = 1, {}
    if mode == "selective" and every == PER_OP:
        options = {"context_fn": per_op_context}
    elif mode == "selective":
        k = int(every)
    wrapped = 0
    for name, block in list(model.layers.items()):
        if int(name) % k == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, **options)
            wrapped += 1
    return wrapped
