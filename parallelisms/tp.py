"""Tensor and sequence parallelism for the Llama, and the loss style that goes with it.

Embedding rowwise to sequence-sharded activations, norms SequenceParallel, attention and FFN
colwise/rowwise (so each block all-gathers the sequence once before attention and once before
the FFN, and reduce-scatters after each), then the loss: with `[loss] parallel = "sequence"` the
output weight is replicated and each rank takes the loss of its own tokens (LinearLossParallel);
with "vocab" the output weight is sharded on the vocabulary (VocabParallelLinearLoss).

Float8 linear layers with tensorwise scaling get torchao's float8 styles, as in torchtitan: the
shared input of wq/wk/wv (and of w1/w3) is cast to float8 once, before its all-gather, so the
sequence is all-gathered in float8. Rowwise-scaled float8 layers use the plain styles (their
all-gathers stay in high precision) and cast inside the layer; so do all of them on the CPU
across processes, where gloo has no float8 types to all-gather (the same float8 GEMMs, from
high-precision all-gathers)."""

import typing

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from components.config.schema import LossParallel
from components.float8_linear import is_float8_tensorwise
from flce.parallel import LinearLossParallel, VocabParallelLinearLoss
from models.args import LlamaArgs
from models.llama import TransformerBlock

LOSS_PARALLEL = typing.get_args(LossParallel)


def check_tp_degree(args: LlamaArgs, flavor: str, tp: int, seq_len: int) -> None:
    """Refuse, before anything is built, a degree that the plan below cannot cut evenly.

    The attention projections are cut by heads (a rank's slice must be whole query and kv
    heads), and w1/w3 and w2 must cut the FFN's hidden size alike, which uneven cuts do not;
    sequence parallelism cuts every sequence into tp equal pieces (uneven ones crashed gloo).
    The vocabulary may be cut unevenly: both loss styles handle short and empty slices."""
    if tp == 1:
        return
    dims = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "ffn_dim": args.ffn_dim}
    for name, value in dims.items():
        if value % tp:
            fitting = [d for d in range(1, args.n_kv_heads + 1)
                       if all(v % d == 0 for v in dims.values())]
            raise ValueError(f"[parallelism] tensor_parallel_degree = {tp} does not divide the "
                             f"{flavor} flavor's {name} = {value} ([model] flavor); degrees "
                             f"that fit it: {', '.join(map(str, fitting))}")
    if seq_len % tp:
        raise ValueError(f"[parallelism] tensor_parallel_degree = {tp} does not divide "
                         f"[training] seq_len = {seq_len}: sequence parallelism cuts every "
                         f"sequence into {tp} equal pieces")


def _shard_rows(name, module, mesh):
    for param_name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))


def _styles(*linears: nn.Module, float8_gathers: bool) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) styles for linear layers that read the same input:
    torchao's float8 ones only if the mesh can all-gather float8 and every one of them is a
    tensorwise Float8Linear (the prepared input is cast to float8 for all of them)."""
    if float8_gathers and all(is_float8_tensorwise(linear) for linear in linears):
        from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel,
                                                           Float8RowwiseParallel,
                                                           PrepareFloat8ModuleInput)
        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def check_loss_parallel(loss_parallel: str, impl: str, memory_lean: bool, float8: str) -> None:
    """Refuse, before anything is built, a [loss] setting the loss's tensor-parallel style
    cannot honour (train.py checks it with the config; apply_tp again)."""
    if loss_parallel not in LOSS_PARALLEL:
        raise ValueError(f"[loss] parallel = {loss_parallel!r}: expected one of {LOSS_PARALLEL}")
    if loss_parallel != "vocab":
        return
    if impl not in ("flce", "unfused"):
        raise ValueError(f"[loss] impl = {impl!r} has no vocab-parallel form: use \"flce\" "
                         "or \"unfused\" with [loss] parallel = \"vocab\"")
    if memory_lean:
        raise ValueError("[loss] memory_lean has no vocab-parallel form (that loss keeps only its "
                         "vocabulary slice's dW): set it false with [loss] parallel = \"vocab\"")
    if float8 != "none":
        raise ValueError(f"[loss] float8 = {float8!r} has no vocab-parallel form yet: use "
                         "[loss] parallel = \"sequence\" or float8 = \"none\"")


def apply_tp(model_with_loss: nn.Module, tp_mesh: DeviceMesh, loss_parallel: str) -> None:
    loss = model_with_loss.loss
    check_loss_parallel(loss_parallel, loss.impl, loss.memory_lean, loss.float8)
    model = model_with_loss.model
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    })
    # The embedding's output is a view of its reduce-scatter's result. Under FSDP and a compiled
    # first block, its gradient came back zero (gloo, CPU; FSDP warns that a view output can
    # lose its pre-backward hook): the blocks get a tensor of their own, B x T/TP x H copied.
    model.tok_embeddings.register_forward_hook(lambda module, args, out: out.clone())
    # gloo's all-gather of float8 fails in the first forward ("Invalid scalar type")
    float8_gathers = tp_mesh.device_type != "cpu" or tp_mesh.size() == 1
    for name, block in model.layers.items():
        if not isinstance(block, TransformerBlock):
            # parallelize_module skips plan entries it cannot find, so a block wrapped (by
            # activation checkpointing or compile) would silently stay unsharded.
            raise TypeError(f"layers.{name} is a {type(block).__name__}: apply tensor "
                            "parallelism before activation checkpointing and compile wrap blocks")
        attention, ffn = block.attention, block.feed_forward
        qkv_colwise, _, attention_input = _styles(attention.wq, attention.wk, attention.wv,
                                                  float8_gathers=float8_gathers)
        _, wo_rowwise, _ = _styles(attention.wo, float8_gathers=float8_gathers)
        w13_colwise, _, ffn_input = _styles(ffn.w1, ffn.w3, float8_gathers=float8_gathers)
        _, w2_rowwise, _ = _styles(ffn.w2, float8_gathers=float8_gathers)
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": attention_input(input_layouts=(Shard(1), None),
                                         desired_input_layouts=(Replicate(), None)),
            "attention.wq": qkv_colwise(),
            "attention.wk": qkv_colwise(),
            "attention.wv": qkv_colwise(),
            "attention.wo": wo_rowwise(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": ffn_input(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": w13_colwise(),
            "feed_forward.w2": w2_rowwise(output_layouts=Shard(1)),
            "feed_forward.w3": w13_colwise(),
        })
    if loss_parallel == "sequence":
        distribute_module(model.output, tp_mesh)  # replicated: every rank holds all of it
        parallelize_module(loss, tp_mesh, LinearLossParallel(seq_dim=1))
    else:
        distribute_module(model.output, tp_mesh, _shard_rows)  # rows = vocabulary
        # impl "unfused" gets the unfused vocab-parallel loss, so curves stay comparable
        parallelize_module(loss, tp_mesh, VocabParallelLinearLoss(
            seq_dim=1, chunk_size=loss.chunk_size, fused=loss.impl == "flce"))
