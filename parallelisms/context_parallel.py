"""Context parallelism: every sequence is cut over the "cp" mesh dimension, attention is a ring.

PyTorch's own CP (torch.distributed.tensor.experimental.context_parallel, as torchtitan 0.2.0's
train loop uses it): around each micro-batch's forward and backward, the inputs, the labels and
the model's RoPE table are sharded in place on the sequence, load-balanced (head-tail: with
cp = 2 rank 0 holds quarters 1 and 4, rank 1 quarters 2 and 3, so both do the same causal
work), and F.scaled_dot_product_attention runs as ring attention: each rank's queries meet
every rank's keys and values, passed round by all-gather or all-to-all
([parallelism] context_parallel_rotate_method). Everything else (the blocks' linear layers,
norms, the fused loss) works token by token, so it runs unchanged on a rank's own tokens; the
loss is each rank's sum over its tokens divided by the global token count, and the gradients
of the cp ranks are summed by FSDP, which shards over dp_shard x cp (parallelisms/mesh.py).

PyTorch routes to the ring only the CUDA attention kernels (flash, efficient, cuDNN). On the
CPU its CP stops at "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered" (torch 2.11-2.13), so for gloo runs (tests, debugging)
`enable_cpu_ring_attention` hands that kernel to the same ring loop PyTorch's CUDA path uses
(_templated_ring_attention and its backward), through PyTorch's table of CP kernels.
"""

import contextlib
import typing

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from components.config.schema import RotateMethod

ROTATE_METHODS = typing.get_args(RotateMethod)


def check_context_parallel(cp: int, tp: int, seq_len: int, sdpa_backend: str) -> None:
    """Refuse, before anything is built, what CP cannot shard or route to its ring."""
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise ValueError(f"[parallelism] context_parallel_degree = {cp} does not fit [training] "
                         f"seq_len = {seq_len}: the load-balanced sharding cuts every sequence "
                         f"into 2 x {cp} equal pieces, so seq_len must be a multiple of {2 * cp}")
    if sdpa_backend == "math":
        # the math kernel is made of ordinary ops, which DTensor would run on the whole
        # (load-balanced, so reordered) sequence with a causal mask of the wrong order
        raise ValueError("[model] sdpa_backend = \"math\" has no context-parallel (ring) form: "
                         "use \"auto\", \"cudnn\", \"flash\" or \"efficient\" with [parallelism] "
                         "context_parallel_degree > 1")
    if tp > 1 and (seq_len // cp) % tp:
        raise ValueError(f"[parallelism] tensor_parallel_degree = {tp} does not divide a context-"
                         f"parallel rank's {seq_len // cp} tokens ([training] seq_len {seq_len} / "
                         f"context_parallel_degree {cp}): sequence parallelism cuts them into "
                         f"{tp} equal pieces")


class SequenceSharding:
    """shard(inputs, labels): a context in which this rank holds its part of the micro-batch.

    inputs and labels [B, T] on the device, T the model's RoPE length; forward and backward both
    belong inside (the backward of ring attention is a ring too). They, and the RoPE table, are
    put back whole when the context ends."""

    def __init__(self, cp_mesh: DeviceMesh, model: torch.nn.Module, rotate_method: str):
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        if rotate_method not in ROTATE_METHODS:
            raise ValueError(f"[parallelism] context_parallel_rotate_method = {rotate_method!r}: "
                             f"expected one of {ROTATE_METHODS}")
        set_rotate_method(rotate_method)  # process-wide, read by every ring attention call
        if cp_mesh.device_type == "cpu":
            enable_cpu_ring_attention()
        self.mesh = cp_mesh
        self.degree = cp_mesh.size()
        self.model = model  # the Llama: its rope_cache is sharded with the tokens

    @contextlib.contextmanager
    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor):
        """Yields (inputs, labels) to use inside: sharded in place, in this rank's part."""
        from torch.distributed.tensor.experimental import context_parallel

        rope = self.model.rope_cache
        if inputs.shape[1] != rope.shape[0]:
            # the RoPE rows are load-balanced like the tokens only if they are as many
            raise ValueError(f"context parallelism: a batch of {inputs.shape[1]} tokens per "
                             f"sequence, but the model's RoPE table has {rope.shape[0]} rows: "
                             "batches must be [training] seq_len long")
        if inputs.untyped_storage().data_ptr() == labels.untyped_storage().data_ptr():
            # one window's two views, a token apart (a batch of one sequence is contiguous in
            # both, and .to() on the CPU keeps them): sharding one in place wrote into the other
            labels = labels.clone()
        with context_parallel(self.mesh, buffers=[inputs, labels, rope],
                              buffer_seq_dims=[1, 1, 0]):
            yield inputs, labels


class NoSharding:
    """Without context parallelism: every rank holds whole sequences."""
    degree = 1

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor):
        return contextlib.nullcontext((inputs, labels))


# ----------------------------------------------------------------------------------------- CPU

def _local(value):
    return value._local_tensor if isinstance(value, DTensor) else value


def _sharded(tensors, mesh: DeviceMesh) -> tuple:
    # every output of the CPU kernel and its backward is [B, heads, T(, head_dim)]: seq dim 2
    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in tensors)


def _cpu_ring_forward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._attention import _templated_ring_attention

    query, key, value, *rest = args
    options = {**dict(zip(("dropout_p", "is_causal"), rest)), **kwargs}
    is_causal = options.pop("is_causal", False)
    mesh = query.device_mesh
    out, logsumexp = _templated_ring_attention(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        query=_local(query), key=_local(key), value=_local(value), is_causal=is_causal,
        **{k: _local(v) for k, v in options.items()})
    return _sharded((out, logsumexp), mesh)


def _cpu_ring_backward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward)

    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    named = {**dict(zip(names, args)), **kwargs}
    mesh = named["query"].device_mesh
    named = {k: _local(v) for k, v in named.items()}
    grads = _templated_ring_attention_backward(
        mesh.get_group(), 2,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out_name="grad_out", **named)
    return _sharded(grads[:3], mesh)


def enable_cpu_ring_attention() -> None:
    """Add the CPU attention kernel to the kernels PyTorch's CP runs as a ring (idempotent).

    PyTorch installs its table (custom_ops) as DTensor's op handlers while a context_parallel
    block runs, so the CPU entries take effect, and are removed, exactly when its own do."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
        table = _attention.custom_ops
        _attention._templated_ring_attention_backward  # noqa: B018 (present, or ImportError)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"context parallelism on the CPU needs PyTorch's private ring "
                           f"attention (torch 2.11-2.13 have it; this is {torch.__version__}): "
                           f"{e}") from e
    aten = torch.ops.aten
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = _cpu_ring_forward
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _cpu_ring_backward
