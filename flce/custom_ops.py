"""The loss as torch.library custom ops: opaque to torch.compile, with fake (meta) kernels.

block_forward / block_backward: the one-block path (`ops.py`; the logits of all tokens kept from
forward to backward, which overwrites them with dlogits). fused_forward: loss and gradients in
one chunked sweep (reductions mean/sum); token_losses and token_losses_backward: chunked
reduction "none" (backward recomputes the logits), and losses without gradients;
sweep_forward / sweep_backward: memory_lean's sweep over vocabulary slices for reduction
"none" (for mean and sum fused_forward takes it); scale_cast /
scale_ (through scale_to): the chunked backward's multiply by the upstream gradient, rounded once
to the parameter dtype.
"""

import functools
import hashlib
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from flce.dispatch import stat_dtype, triton_usable, weight_of_sum
from flce.float8 import padded
from flce.ops import block_grads, block_stats, chunked_pass, gemm_vocab
from flce.options import LossOptions
from flce.vocab_sweep import sweep_grads, sweep_pass, sweep_stats, uses_vocab_sweep

_EMPTY = (0,)


def source_digest(package: Path) -> str:
    """8 hex digits of a hash of the package's Python sources."""
    h = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:8]


# The ops are torch.ops.flce_<digest>.<name>. Inductor's on-disk cache keys a compiled graph on
# the ops it calls by name, not on their fake kernels: a graph cached by an flce whose fakes gave
# other output shapes would be reused and fail its size asserts ("incorrect fake (aka meta)
# kernel"). With the sources' digest in the name, another flce means other names and a new graph.
NAMESPACE = f"flce_{source_digest(Path(__file__).parent)}"


def _op(name: str, mutates_args=()):
    """A torch.library custom op for torch.compile (opaque to it, traced through its fake
    kernel), called as a plain Python function in eager mode: the dispatcher's round trip and
    argument conversion cost tens of microseconds per call, which is most of the loss's time at
    a few thousand tokens. Fake tensors (tracing without compile) still go through the op."""
    def wrap(fn):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args)

        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling() or isinstance(args[0], FakeTensor):
                return op(*args)
            return fn(*args)
        call.register_fake = op.register_fake
        return call
    return wrap


@functools.lru_cache(maxsize=64)  # checked once per set of options, not once per call
def _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap) -> LossOptions:
    return LossOptions(ignore_index, label_smoothing, logit_scale, z_loss, softcap)


def _dense_like(t: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A fake gradient as the real ops make it: contiguous whatever the input's strides
    (`empty_like` keeps a transposed x's or W's, and Inductor then asserts them on the real
    gradient)."""
    return t.new_empty(t.shape, dtype=dtype or t.dtype)


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty(_EMPTY) if t is None else t


@_op("fused_forward", mutates_args=())
def fused_forward(
    x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor], loss_weight: Tensor,
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], chunk_size: Optional[int], lean: bool, float8: str,
    use_triton: bool, need_dx: bool, need_dw: bool, need_db: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Loss (sum of token losses times loss_weight) and the gradients of the unweighted sum,
    left in their fp32 accumulators; lean: of the weighted sum, in the parameter dtypes."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    # The kernel writes unweighted dlogits: their bf16 rounding then does not depend on the batch's
    # token count, and loss_weight is applied exactly, in fp32, with the upstream gradient. Lean
    # gradients are rounded to bf16 as they accumulate anyway: loss_weight goes into dlogits, so
    # that backward leaves them as they are for the usual upstream gradient of 1.
    row_weight = loss_weight if lean else torch.ones((), device=x.device, dtype=stat_dtype(x))
    (N, H), V = x.shape, weight.shape[0]
    if (need_dx or need_dw or need_db) and uses_vocab_sweep(N, H, V, x.element_size(),
                                                            chunk_size, lean, float8):
        loss, dx, dw, db = sweep_pass(x, target, weight, bias, row_weight, opts, use_triton,
                                      need_dx, need_dw, need_db)
    else:
        loss, dx, dw, db = chunked_pass(
            x, target, weight, bias, row_weight, None, False, opts, chunk_size, lean,
            use_triton, need_dx, need_dw, need_db, cast_grads=False, float8=float8)
    return loss.sum() * loss_weight, _or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight)


@fused_forward.register_fake
def _(x, target, weight, bias, loss_weight, ignore_index, label_smoothing, logit_scale, z_loss,
      softcap, chunk_size, lean, float8, use_triton, need_dx, need_dw, need_db):
    acc = weight.dtype if lean else torch.promote_types(torch.float32, weight.dtype)
    return (x.new_empty((), dtype=stat_dtype(x)),
            _dense_like(x, x.dtype if lean else stat_dtype(x)) if need_dx
            else x.new_empty(_EMPTY),
            _dense_like(weight, acc) if need_dw else weight.new_empty(_EMPTY),
            _dense_like(bias, stat_dtype(x)) if need_db else weight.new_empty(_EMPTY))


@_op("block_forward", mutates_args=())
def block_forward(
    x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], float8: str, use_triton: bool, keep_off_max: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(per-token loss, row max, log sum exp(z - max), the logits of all tokens, row maxima off
    the target or empty, W's column maxima or empty: the last two with keep_off_max)."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    loss, row_max, log_sum, logits, off_max, w_col_absmax = block_stats(
        x, target, weight, bias, opts, use_triton, float8, keep_off_max)
    return (loss, row_max, log_sum, logits, _or_empty(off_max, loss),
            _or_empty(w_col_absmax, loss))


@block_forward.register_fake
def _(x, target, weight, bias, ignore_index, label_smoothing, logit_scale, z_loss, softcap,
      float8, use_triton, keep_off_max):
    n, V = x.shape[0], weight.shape[0]
    stat = x.new_empty((n,), dtype=stat_dtype(x))
    width = gemm_vocab(V, x.element_size()) if float8 == "none" else padded(V)
    return (stat, torch.empty_like(stat), torch.empty_like(stat), x.new_empty((n, width)),
            torch.empty_like(stat) if keep_off_max else stat.new_empty(_EMPTY),
            x.new_empty((weight.shape[1],), dtype=torch.float32) if keep_off_max
            else stat.new_empty(_EMPTY))


# block_backward overwrites `logits` with dlogits, yet says it mutates nothing: its caller (the
# one-block autograd Function) is the logits' only reader after forward, so nothing can see the
# change, and a declared mutation makes torch.compile copy the whole [N, V] buffer before the
# call (auto-functionalization: a full extra read and write). The Function bumps the logits'
# version, so a second backward over them (retain_graph=True) raises instead of reading dlogits.
@_op("block_backward", mutates_args=())
def block_backward(
    logits: Tensor, row_weight: Tensor, row_scale: Optional[Tensor], x: Tensor, target: Tensor,
    weight: Tensor, bias: Optional[Tensor], row_max: Tensor, log_sum: Tensor, off_max: Tensor,
    w_col_absmax: Tensor,
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], float8: str, use_triton: bool,
    need_dx: bool, need_dw: bool, need_db: bool, release_stats: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dW, db) of the one-block path; logits are overwritten with dlogits. release_stats:
    row_max, log_sum and row_scale are freed after the row pass (`ops.block_grads`)."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    dx, dw, db = block_grads(logits, row_weight, row_scale, x, target, weight, bias,
                             (row_max, log_sum),
                             off_max if off_max.numel() else None,
                             w_col_absmax if w_col_absmax.numel() else None, opts, use_triton,
                             float8, need_dx, need_dw, need_db, release_stats)
    return _or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight)


@block_backward.register_fake
def _(logits, row_weight, row_scale, x, target, weight, bias, row_max, log_sum, off_max,
      w_col_absmax, ignore_index, label_smoothing, logit_scale, z_loss, softcap, float8,
      use_triton, need_dx, need_dw, need_db, release_stats):
    return (_dense_like(x) if need_dx else x.new_empty(_EMPTY),
            _dense_like(weight) if need_dw else weight.new_empty(_EMPTY),
            _dense_like(bias) if need_db else weight.new_empty(_EMPTY))


@_op("token_losses", mutates_args=())
def token_losses(
    x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], chunk_size: Optional[int], float8: str, use_triton: bool,
    keep_stats: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-token losses, no gradients (chunked reduction "none" forward, and evaluation), and
    with keep_stats each row's (max, log sum exp(z - max)) for token_losses_backward."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    stat = stat_dtype(x)
    stats = tuple(x.new_empty(x.shape[0] if keep_stats else 0, dtype=stat) for _ in range(2))
    one = torch.ones((), device=x.device, dtype=stat)
    loss, _, _, _ = chunked_pass(x, target, weight, bias, one, stats if keep_stats else None,
                                 False, opts, chunk_size, False, use_triton, False, False, False,
                                 cast_grads=True, float8=float8)
    return loss, *stats


@token_losses.register_fake
def _(x, target, weight, bias, ignore_index, label_smoothing, logit_scale, z_loss, softcap,
      chunk_size, float8, use_triton, keep_stats):
    n, stat = x.shape[0], stat_dtype(x)
    kept = n if keep_stats else 0
    return (x.new_empty((n,), dtype=stat), x.new_empty((kept,), dtype=stat),
            x.new_empty((kept,), dtype=stat))


@_op("token_losses_backward", mutates_args=())
def token_losses_backward(
    grad: Tensor, x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
    row_max: Tensor, log_sum: Tensor,
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], chunk_size: Optional[int], lean: bool, float8: str,
    use_triton: bool, need_dx: bool, need_dw: bool, need_db: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients for any per-token upstream gradient: recomputes each chunk's logits."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    _, dx, dw, db = chunked_pass(
        x, target, weight, bias, grad.to(row_max.dtype), (row_max, log_sum), True, opts,
        chunk_size, lean, use_triton, need_dx, need_dw, need_db, cast_grads=True, float8=float8)
    return _or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight)


@token_losses_backward.register_fake
def _(grad, x, target, weight, bias, row_max, log_sum, ignore_index, label_smoothing,
      logit_scale, z_loss, softcap, chunk_size, lean, float8, use_triton, need_dx, need_dw,
      need_db):
    return (_dense_like(x) if need_dx else x.new_empty(_EMPTY),
            _dense_like(weight) if need_dw else weight.new_empty(_EMPTY),
            _dense_like(bias) if need_db else weight.new_empty(_EMPTY))


@_op("sweep_forward", mutates_args=())
def sweep_forward(
    x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], use_triton: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """memory_lean's vocabulary sweep for reduction "none", forward (`vocab_sweep.sweep_stats`):
    (per-token loss, row max, log sum exp(z - max)); fused_forward runs it for mean and sum."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    return sweep_stats(x, target, weight, bias, opts, use_triton)


@sweep_forward.register_fake
def _(x, target, weight, bias, ignore_index, label_smoothing, logit_scale, z_loss, softcap,
      use_triton):
    stat = x.new_empty((x.shape[0],), dtype=stat_dtype(x))
    return stat, torch.empty_like(stat), torch.empty_like(stat)


@_op("sweep_backward", mutates_args=())
def sweep_backward(
    row_weight: Tensor, x: Tensor, target: Tensor, weight: Tensor,
    bias: Optional[Tensor], loss: Tensor, row_max: Tensor, log_sum: Tensor,
    ignore_index: int, label_smoothing: float, logit_scale: float, z_loss: float,
    softcap: Optional[float], use_triton: bool, need_dx: bool, need_dw: bool, need_db: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """memory_lean's vocabulary sweep for reduction "none", backward (`vocab_sweep.sweep_grads`
    with the per-token upstream gradient): (dx, dW, db)."""
    opts = _opts(ignore_index, label_smoothing, logit_scale, z_loss, softcap)
    dx, dw, db = sweep_grads(row_weight, x, target, weight, bias, loss,
                             (row_max, log_sum), opts, use_triton, need_dx, need_dw, need_db)
    return _or_empty(dx, x), _or_empty(dw, weight), _or_empty(db, weight)


@sweep_backward.register_fake
def _(row_weight, x, target, weight, bias, loss, row_max, log_sum, ignore_index,
      label_smoothing, logit_scale, z_loss, softcap, use_triton, need_dx, need_dw, need_db):
    return (_dense_like(x) if need_dx else x.new_empty(_EMPTY),
            _dense_like(weight) if need_dw else weight.new_empty(_EMPTY),
            _dense_like(bias) if need_db else weight.new_empty(_EMPTY))


@_op("weighted_sum", mutates_args=())
def weighted_sum(loss: Tensor, target: Tensor, normalizer: Optional[Tensor],
                 inv_divisor: Optional[float], ignore_index: int, use_triton: bool
                 ) -> Tuple[Tensor, Tensor]:
    """(sum(loss) * w, w) with w = 1 / the divisor `dispatch.divisor_of` describes: the loss of
    the one-block path and the weight its backward applies. On the GPU one kernel."""
    if not use_triton:
        w = weight_of_sum(target, normalizer, inv_divisor, ignore_index, loss.device, loss.dtype)
        return loss.sum() * w, w
    from flce.kernels import weighted_sum as triton_weighted_sum
    out, w = loss.new_empty(()), loss.new_empty(())
    if normalizer is not None and normalizer.device != loss.device:
        normalizer = normalizer.to(loss.device)
    triton_weighted_sum(loss, target, normalizer, inv_divisor, ignore_index, out, w)
    return out, w


@weighted_sum.register_fake
def _(loss, target, normalizer, inv_divisor, ignore_index, use_triton):
    return loss.new_empty(()), loss.new_empty(())


def scale_to(acc: Tensor, grad: Tensor, dtype: torch.dtype) -> Tensor:
    """acc * grad computed in acc's precision and rounded once to dtype (in place if same)."""
    if acc.dtype == dtype:
        scale_(acc, grad)
        return acc
    return scale_cast(acc, grad, dtype)


def _fast_scale(t: Tensor) -> bool:
    return t.is_cuda and triton_usable(t.device)


@_op("scale_cast", mutates_args=())
def scale_cast(src: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    dst = torch.empty_like(src, dtype=dtype)
    if _fast_scale(src):
        from flce.kernels import scale_cast as triton_scale_cast
        return triton_scale_cast(src, dst, scale)
    return torch.mul(src, scale, out=dst)


@scale_cast.register_fake
def _(src, scale, dtype):
    return torch.empty_like(src, dtype=dtype)


@_op("scale_", mutates_args=("t",))
def scale_(t: Tensor, scale: Tensor) -> None:
    if _fast_scale(t):
        from flce.kernels import scale_cast as triton_scale_cast
        triton_scale_cast(t, t, scale)
    else:
        t.mul_(scale)


@scale_.register_fake
def _(t, scale):
    return None
