"""memory_lean at few tokens and a large vocabulary: the loss swept over slices of the vocabulary
instead of chunks of the tokens.

memory_lean's logits buffer is about the size of x (Liger-Kernel's memory). Over token chunks
that is N·H/V tokens a chunk, a few dozen or fewer at a few thousand tokens and a vocabulary of
100k+, and every chunk reads W twice and reads and writes dW: W's traffic, not the GEMMs'
work, sets the time (on an H200 at 2048x1024x256000, 93 ms against 4.8 ms of GEMMs). The same
buffer holds the logits of all N tokens over a slice of about H columns of the vocabulary, so
sweeping the slices reads W and writes dW once. The rows' softmax statistics over the slices
combine as those of the vocab-parallel loss's ranks do (`vocab_slices.py`):

- the statistics pass (`sweep_stats`): per slice, logits = x @ W_s.T (+ b_s) and their per-row
  (max, sum-exp, target logit, sum); combined, STATS_GROUP slices at a time, into the loss and
  each row's (max, log sum exp(z - max));
- the gradient pass (`sweep_grads`): per slice, the logits again, turned into dlogits in place
  with the row weights folded in, then dW_s = dlogits.T @ x (one GEMM over all tokens, rounded
  once), db_s, and dx += dlogits @ W_s, accumulated in the parameter dtype as memory_lean
  accumulates dW over its token chunks.

For reductions "mean" and "sum" both run in forward (`sweep_pass`, as memory_lean's token chunks
do: the loss weight folded in, backward scales by the upstream gradient), the row statistics in
the tail of the logits buffer. For reduction "none" forward keeps the statistics and backward
runs the gradient pass with the per-token upstream gradient.

8·N·H·V FLOPs against the token chunks' 6 (the logits GEMM runs twice), taken where those
chunks would hold SWEEP_MAX_TOKENS tokens or fewer and W is large (`uses_vocab_sweep`).
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from flce.dispatch import stat_dtype
from flce.ops import gemm_operands, gemm_vocab, pick_chunk_size, unpadded
from flce.options import LossOptions
from flce.reference import check_targets
from flce.vocab_slices import combine_slices, loss_from_sums, slice_grads, slice_stats

# Where memory_lean's token chunks hold 128 tokens or fewer and W is large, the sweep took
# 1.5-4.9x less time than they did (benchmarks/flce_lean_sweep_h200.md against the grid's
# memory_lean column, 14 points on an H200). At 256-token chunks each chunk's dW GEMM (K = 256,
# adding into dW) is bound by dW's traffic: the sweep took the same time or less at all six such
# points of a probe on an H200 (2048 <= H <= 8192, V 128256 and 256000; 5% less at H = 8192) and
# 17% less at 4096x8192x128256 on an H100, whose bandwidth is lower for its FLOPs; at 512-1024
# token chunks the chunks were 15-40% faster (the sweep's second logits GEMM). Both probes forced
# each path in interleaved rounds (`python3 -m scripts.bench.flce --lean-paths`), not kept as
# reports. A slice costs about as many launches as a chunk, twice over: where W is small the
# host's launches can set the time. On an H100 (benchmarks/flce_lean_paths_h100.md, timed
# synchronised and with the host ahead) the sweep was faster both ways at W of 65.5M-131M
# elements (2048x1024x128256: 9.5 against 32.1 ms synchronised; 2048x2048x32000,
# 16384x1024x128256 and three more), and at 2048x1024x32000 (W just under 2^25) only with the
# host ahead (1.8 against 4.3 ms); synchronised, its 5.6 ms of host time a call lost (5.7
# against 4.7 ms), hence the bound on W.
SWEEP_MAX_TOKENS = 256        # memory_lean's token chunks this short or shorter ...
SWEEP_MIN_WEIGHT = 1 << 25    # ... and W of this many elements (V x H) at least: sweep
STATS_GROUP = 32              # slices whose row statistics are combined in one go
KEPT_BYTES_PER_TOKEN = 3 * 8  # loss, row max, log sum between the passes, float64 at most


def sweep_columns(n_tokens: int, hidden: int, vocab: int, elem_bytes: int) -> int:
    """Vocabulary columns a slice, a multiple of 16 (at least 16): all tokens' logits and the
    statistics kept between the two passes in no more memory than memory_lean's token chunk
    would take (`ops.pick_chunk_size`), whose sweep keeps nothing."""
    chunk = pick_chunk_size(n_tokens, hidden, vocab, elem_bytes, None, lean=True)
    return _columns_within(chunk, n_tokens, vocab, elem_bytes)


def _columns_within(chunk: int, n_tokens: int, vocab: int, elem_bytes: int) -> int:
    n = max(n_tokens, 1)
    budget = chunk * vocab * elem_bytes - KEPT_BYTES_PER_TOKEN * n
    return max(16, budget // (n * elem_bytes) // 16 * 16)


def uses_vocab_sweep(n_tokens: int, hidden: int, vocab: int, elem_bytes: int,
                     chunk_size: Optional[int], lean: bool, float8: str) -> bool:
    """Whether a memory_lean call with gradients sweeps the vocabulary: its token chunks would be
    no longer than SWEEP_MAX_TOKENS (and shorter than N), W has SWEEP_MIN_WEIGHT elements or
    more, and the vocabulary takes more than one slice.
    Not with a chunk_size given (the token chunks asked for) nor with float8 GEMMs."""
    if not lean or chunk_size is not None or float8 != "none" or vocab * hidden < SWEEP_MIN_WEIGHT:
        return False
    chunk = pick_chunk_size(n_tokens, hidden, vocab, elem_bytes, None, lean=True)
    return (chunk <= SWEEP_MAX_TOKENS and chunk < n_tokens
            and _columns_within(chunk, n_tokens, vocab, elem_bytes) < vocab)


def sweep_buffer(x: Tensor, weight: Tensor, keep_stats: bool) -> tuple[Tensor, Optional[Tensor]]:
    """The sweep's one buffer: room for a slice's logits of all tokens (`sweep_columns`), in x's
    dtype, and with keep_stats the rows' (max, log sum) behind them ([2, N], fp32 or float64):
    kept there, they take none of the memory the slices left them (KEPT_BYTES_PER_TOKEN) on top
    of the buffer, which is what keeps the peak within Liger-Kernel's."""
    N, (V, H) = x.shape[0], weight.shape
    elem = x.element_size()
    logits_bytes = N * gemm_vocab(min(V, sweep_columns(N, H, V, elem)), elem)
    logits_bytes *= elem
    stat = stat_dtype(x)
    stats_bytes = 2 * N * stat.itemsize if keep_stats else 0
    raw = torch.empty(logits_bytes + stats_bytes, device=x.device, dtype=torch.uint8)
    logits = raw[:logits_bytes].view(x.dtype)  # offsets: multiples of 16 columns, so aligned
    return logits, raw[logits_bytes:].view(stat).view(2, N) if keep_stats else None


class _Slice(NamedTuple):
    start: int           # its first class
    cols: int            # its classes
    w_s: Tensor          # [width, H]: W's rows, with zero rows up to the GEMM width
    w_t: Tensor          # W_s.T
    b_s: Optional[Tensor]
    logits: Tensor       # [N, width], a view of the buffer
    logits_t: Tensor     # its transpose
    rows: Tensor         # logits[:, :cols], the columns the loss takes


def _slices(x: Tensor, weight: Tensor, bias: Optional[Tensor], buf: Tensor) -> list[_Slice]:
    """The vocabulary's slices, their views made once a call for both passes: every slice but
    the last is `cols` wide and shares one [N, cols] view of buf (`sweep_buffer`) for its
    logits. The last slice's W_s (and b_s) has zero rows up to its GEMM width where its rows are
    not whole 16-byte words (`ops.gemm_vocab`, an odd vocabulary), and its logits those
    columns, 0. Views made per slice and pass (19-24 aten ops a slice) took the host longer than
    the slices' GEMMs at a few thousand tokens (2048x1024x128256 on an H100: 10.2 ms of host a
    call against 5.0 of GPU); what is left a slice is its GEMMs and its two launches."""
    N, V = x.shape[0], weight.shape[0]
    # buf holds N rows of sweep_columns (a multiple of 16: its own GEMM width), or of all V
    # padded to their GEMM width where one slice takes the whole vocabulary
    cols = min(V, buf.numel() // max(N, 1))
    whole = buf[: N * cols].view(N, cols)
    whole_t = whole.t()
    w_parts, w_t_parts = weight.split(cols), weight.t().split(cols, dim=1)
    b_parts = [None] * len(w_parts) if bias is None else bias.split(cols)
    slices = []
    for i, (w_s, w_t, b_s) in enumerate(zip(w_parts, w_t_parts, b_parts)):
        n = w_s.shape[0]
        w_s, b_s = gemm_operands(w_s, b_s)
        width = w_s.shape[0]
        if width != n:  # the last slice, padded to its GEMM width: a copy of W's rows
            w_t = w_s.t()
        if width == cols:
            logits, logits_t = whole, whole_t
        else:  # the last slice, narrower
            logits = buf[: N * width].view(N, width)
            logits_t = logits.t()
        rows = logits if n == width else logits[:, :n]
        slices.append(_Slice(i * cols, n, w_s, w_t, b_s, logits, logits_t, rows))
    return slices


def _logits_into(x: Tensor, s: _Slice) -> None:
    if s.b_s is None:
        torch.mm(x, s.w_t, out=s.logits)
    else:
        torch.addmm(s.b_s, x, s.w_t, out=s.logits)


def sweep_stats(x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
                opts: LossOptions, use_triton: bool, buf: Optional[Tensor] = None,
                kept: Optional[Tensor] = None, slices: Optional[list[_Slice]] = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: (per-token loss, row max, log sum exp(z - max)), the statistics over the whole
    vocabulary (fp32, float64 for float64 inputs); the last two are kept[0] and kept[1] where
    kept is given (`sweep_buffer`), and the slices' logits go into buf if given (slices: its
    `_slices`, if made already)."""
    N, V = x.shape[0], weight.shape[0]
    stat = stat_dtype(x)
    if buf is None:
        buf = sweep_buffer(x, weight, keep_stats=False)[0]
    # parts[0] holds the slices combined so far, parts[1:] the group being filled
    parts = torch.empty(1 + STATS_GROUP, N, 4, device=x.device, dtype=stat)
    parts[0, :, 0] = float("-inf")  # nothing combined yet: no max, no sums
    parts[0, :, 1:] = 0
    slots = parts.unbind(0)
    if use_triton:
        from flce.kernels import launch_row_stats
    else:
        check_targets(target, opts, V)
    filled = 0
    for s in slices or _slices(x, weight, bias, buf):
        _logits_into(x, s)
        if use_triton:
            launch_row_stats(s.rows, target, slots[1 + filled], opts, s.start,
                             width=s.logits.shape[1])
        else:
            slots[1 + filled].copy_(slice_stats(s.rows, target, opts, s.start))
        filled += 1
        if filled == STATS_GROUP or s.start + s.cols == V:
            parts[0] = combine_slices(parts[: 1 + filled])
            filled = 0
    loss, log_s = loss_from_sums(parts[0, :, 0], parts[0, :, 1:].t(), target, opts, V)
    if kept is None:  # their own tensors: a view of parts would keep all of it until backward
        return loss, parts[0, :, 0].clone(), log_s
    kept[0], kept[1] = parts[0, :, 0], log_s
    return loss, kept[0], kept[1]


def sweep_grads(row_weight: Tensor, x: Tensor, target: Tensor,
                weight: Tensor, bias: Optional[Tensor], loss: Tensor,
                stats: tuple[Tensor, Tensor], opts: LossOptions, use_triton: bool,
                need_dx: bool, need_dw: bool, need_db: bool, buf: Optional[Tensor] = None,
                db_dtype: Optional[torch.dtype] = None, slices: Optional[list[_Slice]] = None):
    """Backward: (dx, dW, db), each None where not needed, in the dtypes of x, weight and bias.
    row_weight: fp32, 0-dim (the loss weight) or [N] (the upstream gradient of reduction
    "none"), folded into dlogits; loss: the per-token losses of forward (NaN rows, bad
    targets, give NaN gradients on the CPU path as the kernel's do); stats: `sweep_stats`';
    buf: the buffer the slices' logits go into, if given (`sweep_buffer`; slices: its
    `_slices`, if made already); db_dtype: db's, if not the bias's."""
    V = weight.shape[0]
    if buf is None:
        buf = sweep_buffer(x, weight, keep_stats=False)[0]
    slices = slices or _slices(x, weight, bias, buf)
    cols = slices[0].cols
    dx = x.new_empty(x.shape) if need_dx else None  # contiguous, as the other paths' gradients
    dw = weight.new_empty(weight.shape) if need_dw else None
    db = bias.new_empty(bias.shape, dtype=db_dtype) if need_db else None
    dw_parts = dw.split(cols) if dw is not None else None
    db_parts = db.split(cols) if db is not None else None
    if use_triton:
        from flce.kernels import launch_rows
    for i, s in enumerate(slices):
        _logits_into(x, s)
        if use_triton:
            # a gradient pass writes no loss: its loss_out (the row maxima) is left as it is
            launch_rows(s.rows, target, stats[0], stats, row_weight, opts, True, True,
                        vocab_start=s.start, vocab_total=V, width=s.logits.shape[1])
        else:
            slice_grads(s.rows, target, loss, *stats, row_weight, opts, s.start, V)
        if dx is not None:
            if i:
                dx.addmm_(s.logits, s.w_s)
            else:
                torch.mm(s.logits, s.w_s, out=dx)
        if dw_parts is not None:
            if s.rows is s.logits:
                torch.mm(s.logits_t, x, out=dw_parts[i])
            else:
                dw_parts[i].copy_(unpadded(torch.mm(s.logits_t, x), s.cols))
        if db_parts is not None:  # summed in the statistics' dtype, rounded once to db's
            if db.dtype == stats[0].dtype:
                torch.sum(s.rows, 0, dtype=db.dtype, out=db_parts[i])
            else:
                db_parts[i].copy_(s.rows.sum(0, dtype=stats[0].dtype))
    return dx, dw, db


def sweep_pass(x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
               row_weight: Tensor, opts: LossOptions, use_triton: bool, need_dx: bool,
               need_dw: bool, need_db: bool):
    """Both passes in forward, for reductions "mean" and "sum" (`ops.chunked_pass`'s contract
    for memory_lean): (per-token loss, dx, dW, db) with row_weight (the loss weight) folded into
    the gradients, dx and dW in the parameter dtypes, db in fp32 (float64 for float64 inputs).
    One buffer holds the slices' logits and the row statistics between the passes, so that the
    peak, in the gradient pass, is the gradients, the per-token losses and that buffer."""
    buf, kept = sweep_buffer(x, weight, keep_stats=True)
    slices = _slices(x, weight, bias, buf)
    loss, *stats = sweep_stats(x, target, weight, bias, opts, use_triton, buf, kept,
                               slices=slices)
    # db in the statistics' dtype, as the chunked sweep's accumulator: backward rounds it once
    dx, dw, db = sweep_grads(row_weight, x, target, weight, bias, loss, tuple(stats),
                             opts, use_triton, need_dx, need_dw, need_db, buf, stats[0].dtype,
                             slices=slices)
    return loss, dx, dw, db
