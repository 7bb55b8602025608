"""Triton kernels for one chunk of tokens: log-sum-exp, loss and the logits gradient, per row.

The chunk loop in `ops.py` runs the GEMMs through cuBLAS; these kernels do the memory-bound part
between them. One program handles one row (token) of the [C, V] logits chunk and walks the
vocabulary in blocks of BLOCK_V:

  pass 1  online max / sum-exp (and the sum of z for label smoothing)   -> loss (max, log sum)
  pass 2  dz_j = w * dz/da_j, written in place over the logits           -> the chunk becomes dlogits

Where both passes run in one kernel, pass 2 walks the row from its last block back to its first
(REVERSE_GRAD), re-reading first the blocks pass 1 read last, while still in L2. On an H200 that
made the kernel alone 4-26% faster on chunks of 2048-16384 rows, and the loss 0.1-3.8% faster
at 6 chunked points (pass 1's order 1.001-1.040x its time), its results bit for bit the same
(`benchmarks/flce_row_order_h200.md`); with the e4m3 copy of dlogits it gained nothing alone,
and pass 2 keeps pass 1's order there. `scripts/bench/tune_rows_kernel.py` and
`scripts/bench/row_order.py` time both orders.

Everything is computed in fp32 from the stored logits; the target-class term is formed in fp32
inside pass 2 (never by patching a rounded value afterwards).

For the float8 dx GEMM (`float8.py`), pass 2 also writes dlogits in e4m3 with the target class's
entry left out, a per-row scale derived from the statistics (pass 1 then also keeps the largest
logit off the target class), and the target entry itself in fp32. The quantization of the GEMMs'
other operands (x, W) is `quantize_kernels.py`.

Math (a = raw logit, s = logit_scale, c = softcap, ls = label_smoothing, zl = z_loss):
  z = c * tanh(s * a / c)  (or z = s * a)           lse = log sum_j exp(z_j)
  loss = (1 - ls) (lse - z_y) + ls (lse - mean_j z_j) + zl lse^2
  dloss/dz_j = p_j (1 + 2 zl lse) - ls / V - (1 - ls) [j == y]
  dz/da = s (1 - (z / c)^2)  (or s)
"""

import torch
import triton
import triton.language as tl

from flce.launch import Launcher
from flce.quantize_kernels import fp8_saturated


@triton.jit
def _tanh(t):
    # No libdevice: the kernels must also run under TRITON_INTERPRET=1 on the CPU. The exp form
    # cancels for small |t|, where the odd Taylor series is exact to fp32 rounding.
    big = 1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0)
    t2 = t * t
    small = t * (1.0 + t2 * (-1.0 / 3.0 + t2 * (2.0 / 15.0 + t2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(t) < 0.125, small, big)


@triton.jit
def _scaled(a, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    z = a * logit_scale
    if HAS_SOFTCAP:
        z = softcap * _tanh(z / softcap)
    return z


@triton.jit
def _row_stats(row_ptr, V, width, logit_scale, softcap, y_local, HAS_SOFTCAP: tl.constexpr,
               HAS_SMOOTHING: tl.constexpr, MAX_OFF_TARGET: tl.constexpr,
               PADDED: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass 1 over one row: max, sum of exp(z - max), sum of z (for label smoothing) and, when
    MAX_OFF_TARGET, the max of z over the columns other than y_local (else -inf). It reads
    `width` columns (PADDED: width > V, the rest padding, left out of every sum).

    The running max is a scalar updated once per block (the block's max first): one exp per
    element. A running max per lane costs a second exp per element (its rescaling), and that
    variant moved 5-13% fewer bytes per second on an H200 (scripts/bench/tune_rows_kernel.py)."""
    cols = tl.arange(0, BLOCK_V)
    m = -1.0e30
    s = 0.0
    sum_z = 0.0
    m_off = -float("inf")
    for start in range(0, width, BLOCK_V):
        loads = start + cols < width
        mask = (start + cols < V) if PADDED else loads
        a = tl.load(row_ptr + start + cols, mask=loads, other=0.0).to(tl.float32)
        z = tl.where(mask, _scaled(a, logit_scale, softcap, HAS_SOFTCAP), -float("inf"))
        block_max = tl.max(z, axis=0)
        m_new = tl.maximum(m, block_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            sum_z += tl.sum(tl.where(mask, z, 0.0), axis=0)
        if MAX_OFF_TARGET:
            # Only the block holding the target needs a reduction of its own: one per row. One
            # per block made the statistics pass 1.5-1.6x slower on an H200.
            off_max = block_max
            if (y_local >= start) & (y_local < start + BLOCK_V):
                off_max = tl.max(tl.where(start + cols == y_local, -float("inf"), z), axis=0)
            m_off = tl.maximum(m_off, off_max)
    return m, s, sum_z, m_off


@triton.jit
def flce_rows_kernel(
    logits_ptr,        # [C, V] raw logits in, dlogits out (when COMPUTE_GRAD)
    stride_row,
    target_ptr,        # [C] int, global class ids
    loss_ptr,          # [C] fp32 out: per-token loss (0 for ignored tokens); untouched when STATS_GIVEN
    max_ptr,           # [C] fp32: the row's max z and log sum exp(z - max), kept apart (lse
    log_sum_ptr,       # would lose z - lse's digits at large logits); out with STORE_STATS, in
                       # with STATS_GIVEN (a gradient pass after a statistics pass)
    weight_ptr,        # fp32 gradient weight: one scalar (weight_stride 0) or one per row
    weight_stride,
    weight_scale_ptr,  # fp32 scalar the gradient weight is multiplied by (HAS_WEIGHT_SCALE)
    V,                 # the columns of this chunk: the vocabulary slice [vocab_start, vocab_start + V)
    width,             # the columns read and written: V, or (PADDED) more, whose padding is read
                       # as nothing and, in a gradient pass, overwritten with 0. A masked access
                       # is vectorized only where its bound is a multiple of 16: an odd V (50257)
                       # made the row pass 3-5x slower on an H200.
    vocab_start,
    V_total,           # the full vocabulary (V and 0 on one device)
    ignore_index,
    logit_scale,
    softcap,
    label_smoothing,
    z_loss,
    g8_ptr,            # [C, V] e4m3 out (FP8_GRAD): dlogits / g8_scale, 0 in the target column
    g8_stride,
    g8_scale_ptr,      # [C] fp32 out (FP8_GRAD): a bound on the row's |dlogits|, / FP8_MAX
    target_grad_ptr,   # [C] fp32 out (FP8_GRAD): dlogits in the target column (0 if not here)
    off_max_ptr,       # [C] fp32: max of z off the target; out with KEEP_OFF_MAX, in with
                       # FP8_GRAD and STATS_GIVEN
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    STATS_GIVEN: tl.constexpr,
    STORE_STATS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    FP8_GRAD: tl.constexpr,
    KEEP_OFF_MAX: tl.constexpr,
    MAX_OFF_TARGET: tl.constexpr,  # pass 1 finds the max off the target (FP8_GRAD or KEEP_OFF_MAX)
    HAS_WEIGHT_SCALE: tl.constexpr,
    REVERSE_GRAD: tl.constexpr,    # pass 2 walks the row's blocks last to first
    PADDED: tl.constexpr,          # width > V
    FP8_MAX: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    g8_row_ptr = g8_ptr + row * g8_stride
    y = tl.load(target_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)

    if y == ignore_index:
        # Ignored rows still write every output: the chunk buffer is reused and feeds the GEMMs.
        if not STATS_GIVEN:  # a gradient pass writes no loss
            tl.store(loss_ptr + row, 0.0)
        if STORE_STATS:
            tl.store(max_ptr + row, 0.0)
            tl.store(log_sum_ptr + row, 0.0)
        if KEEP_OFF_MAX:
            tl.store(off_max_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zero = tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty)
            for start in range(0, width, BLOCK_V):
                tl.store(row_ptr + start + cols, zero, mask=start + cols < width)
            if FP8_GRAD:
                tl.store(g8_scale_ptr + row, 0.0)
                tl.store(target_grad_ptr + row, 0.0)
                zero8 = tl.zeros([BLOCK_V], dtype=g8_ptr.dtype.element_ty)
                for start in range(0, width, BLOCK_V):
                    tl.store(g8_row_ptr + start + cols, zero8, mask=start + cols < width)
        return

    # A target outside [0, V_total) poisons its row with NaN (loss and gradient) instead of
    # reading out of bounds: loud downstream, and no host sync to check it here. Under vocab
    # parallelism a valid target may belong to another rank's slice (owns is then false).
    valid = (y >= 0) & (y < V_total)
    y_local = y - vocab_start
    owns = (y_local >= 0) & (y_local < V)

    a_y = tl.load(row_ptr + tl.where(owns, y_local, 0)).to(tl.float32)
    z_y = tl.where(owns, _scaled(a_y, logit_scale, softcap, HAS_SOFTCAP), 0.0)
    if STATS_GIVEN:  # a gradient pass: the caller already has the loss
        shift = tl.load(max_ptr + row)
        log_s = tl.load(log_sum_ptr + row)
        lse = shift + log_s
        if FP8_GRAD:
            z_off_max = tl.load(off_max_ptr + row)
    else:
        shift, s, sum_z, z_off_max = _row_stats(row_ptr, V, width, logit_scale, softcap, y_local,
                                                HAS_SOFTCAP, HAS_SMOOTHING, MAX_OFF_TARGET,
                                                PADDED, BLOCK_V)
        if KEEP_OFF_MAX:
            tl.store(off_max_ptr + row, z_off_max)
        # Differences are taken against the row max before log(s) is added: with logits ~1e4
        # an fp32 lse has an ulp of ~1e-3, while z - max is exact.
        log_s = tl.log(s)
        lse = shift + log_s
        if STORE_STATS:
            tl.store(max_ptr + row, shift)
            tl.store(log_sum_ptr + row, log_s)
        loss = log_s - (z_y - shift)
        if HAS_SMOOTHING:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_s - (sum_z / V_total - shift))
        if HAS_Z_LOSS:
            loss += z_loss * lse * lse
        tl.store(loss_ptr + row, tl.where(valid, loss, float("nan")))

    if COMPUTE_GRAD:
        w = tl.load(weight_ptr + row * weight_stride).to(tl.float32)
        if HAS_WEIGHT_SCALE:
            w = w * tl.load(weight_scale_ptr).to(tl.float32)
        w = tl.where(valid, w, float("nan"))
        p_coef = 1.0
        if HAS_Z_LOSS:
            p_coef = 1.0 + 2.0 * z_loss * lse
        uniform = 0.0
        if HAS_SMOOTHING:
            uniform = label_smoothing / V_total
        if FP8_GRAD:
            # Off the target, g_j = w s (p_j coef - uniform) softcap'_j with p_j in [0, p_off]
            # and |softcap'_j| <= 1: a bound on the row's |g| (its max when there is no softcap).
            p_off = tl.exp(z_off_max - shift - log_s)
            bound = tl.abs(w * logit_scale) * tl.maximum(tl.abs(p_off * p_coef - uniform), uniform)
            inv_scale = tl.where(bound > 0, FP8_MAX / bound, 0.0)
            tl.store(g8_scale_ptr + row, bound / FP8_MAX)
            g_y = tl.exp(z_y - shift - log_s) * p_coef - uniform - (1.0 - label_smoothing)
            g_y = g_y * (w * logit_scale)
            if HAS_SOFTCAP:
                r_y = z_y / softcap
                g_y = g_y * (1.0 - r_y * r_y)
            tl.store(target_grad_ptr + row, tl.where(owns, g_y, 0.0))
        n_blocks = tl.cdiv(width, BLOCK_V)
        for i in range(0, n_blocks):
            if REVERSE_GRAD:
                start = (n_blocks - 1 - i) * BLOCK_V
            else:
                start = i * BLOCK_V
            offs = start + cols
            mask = offs < width
            a = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            z = _scaled(a, logit_scale, softcap, HAS_SOFTCAP)
            g = tl.exp(z - shift - log_s) * p_coef - uniform
            g = tl.where(offs == y_local, g - (1.0 - label_smoothing), g)
            g = g * (w * logit_scale)
            if HAS_SOFTCAP:
                r = z / softcap
                g = g * (1.0 - r * r)
            if PADDED:
                g = tl.where(offs < V, g, 0.0)
            tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)
            if FP8_GRAD:
                q = fp8_saturated(tl.where(offs == y_local, 0.0, g * inv_scale), FP8_MAX)
                tl.store(g8_row_ptr + offs, q.to(g8_ptr.dtype.element_ty), mask=mask)


@triton.jit
def flce_row_stats_kernel(
    logits_ptr, stride_row, target_ptr,
    stats_ptr,         # [C, 4] fp32 out: max, sum exp(z - max), target logit (0 if not here), sum z
    V, width, vocab_start, ignore_index, logit_scale, softcap,  # width: as flce_rows_kernel's
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, PADDED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Pass 1 of the vocab-parallel loss: what each rank's slice contributes to lse and loss."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    y = tl.load(target_ptr + row).to(tl.int64)
    out = stats_ptr + row * 4
    if y == ignore_index:  # neutral values: the caller masks these rows
        tl.store(out, 0.0)
        tl.store(out + 1, 1.0)
        tl.store(out + 2, 0.0)
        tl.store(out + 3, 0.0)
        return
    y_local = y - vocab_start
    owns = (y_local >= 0) & (y_local < V)
    a_y = tl.load(row_ptr + tl.where(owns, y_local, 0)).to(tl.float32)
    m, s, sum_z, _ = _row_stats(row_ptr, V, width, logit_scale, softcap, y_local, HAS_SOFTCAP,
                                HAS_SMOOTHING, False, PADDED, BLOCK_V)
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, tl.where(owns, _scaled(a_y, logit_scale, softcap, HAS_SOFTCAP), 0.0))
    tl.store(out + 3, sum_z)

@triton.jit
def weighted_sum_kernel(loss_ptr, target_ptr, normalizer_ptr, out_ptr, weight_ptr, N,
                        ignore_index, inv_divisor, DIVISOR: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum(loss) * weight and weight = 1 / divisor, the divisor being (DIVISOR) 0: the
    count of targets != ignore_index (at least 1), 1: the scalar at normalizer_ptr (NaN unless
    finite and > 0), 2: 1 / inv_divisor. One program, a fixed summation order: deterministic."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        mask = start + offs < N
        acc += tl.load(loss_ptr + start + offs, mask=mask, other=0.0)
        if DIVISOR == 0:
            t = tl.load(target_ptr + start + offs, mask=mask, other=ignore_index)
            count += (t != ignore_index).to(tl.int32)
    if DIVISOR == 0:
        weight = 1.0 / tl.maximum(tl.sum(count, axis=0), 1).to(tl.float32)
    elif DIVISOR == 1:
        n = tl.load(normalizer_ptr).to(tl.float32)
        weight = tl.where((n > 0) & (n < float("inf")), 1.0 / n, float("nan"))
    else:
        weight = inv_divisor
    tl.store(out_ptr, tl.sum(acc, axis=0) * weight)
    tl.store(weight_ptr, weight)


_launch_weighted_sum = Launcher(weighted_sum_kernel)


def weighted_sum(loss, target, normalizer, inv_divisor, ignore_index, out, weight):
    """out = sum(loss) * weight, weight = 1 / divisor (`dispatch.divisor_of`): one launch where
    the PyTorch ops take seven (the count, its clamp and reciprocal, the sum, the product)."""
    divisor = 1 if normalizer is not None else (0 if inv_divisor is None else 2)
    target = target.contiguous()  # read as contiguous, like launch_rows
    _launch_weighted_sum((1,), loss, target, loss if normalizer is None else normalizer, out,
                         weight, loss.shape[0], ignore_index,
                         1.0 if inv_divisor is None else float(inv_divisor), DIVISOR=divisor,
                         BLOCK=2048, num_warps=8)


_launch_rows = Launcher(flce_rows_kernel)
_launch_row_stats = Launcher(flce_row_stats_kernel)


# BLOCK_V and warps of each pass at few long rows (`_block_and_warps`)
_FEW_LONG_ROWS = {"stats": (16384, 16), "grad": (16384, 32), "full": (32768, 32),
                  "full+e4m3": (8192, 32)}
# both passes in one at 256-2048 rows of V > 40960 (memory_lean's chunks where N is about
# 128-2048 times V / H)
_SOME_LONG_ROWS_FULL = (16384, 16)


def _block_and_warps(C, V, block_v, num_warps, kind):
    """BLOCK_V and warps of a pass of `kind`: "stats" (pass 1 alone), "grad" (pass 2 alone, after
    a statistics pass), "full" (both) or "full+e4m3" (both, writing the e4m3 copy of dlogits
    for the float8 dx GEMM, float8.py). Tuned on an H200 with scripts/bench/tune_rows_kernel.py
    (8192-32768 rows of 32000-128256 columns): a pass that only reads runs best on 4096-column
    blocks and 4 warps (16 elements a thread; 8 warps 12-50% slower); a gradient pass on 4096 and
    16 warps (8 a thread: its e4m3 copy is 18-30% slower at 16 a thread); both passes in one on
    8192 and 16 warps where rows are short (V <= 40k), 4096 and 8 for longer rows; both with the
    e4m3 copy on 2048 and 8 (8 a thread: 23% faster than 4096/8 at 8192-16384 x 128256). Few
    long rows (C <= 512 and V > 40960, as in the memory-lean chunks at large vocabularies) leave
    one or two programs an SM, each of which must keep more bytes in flight: wider blocks and
    more warps. Timed in shuffled rounds at 16-512 rows x 128256 and 256000 columns, both passes
    in one ran 6-23% faster on 32768 and 32 (Liger-Kernel's choice) than on 8192 and 32 (the
    rule before), the statistics pass best on 16384 and 16, the gradient pass on 16384 and 32;
    at 32000 columns the rules for many rows did as well as any. (The e4m3 pass keeps 8192 and
    32 at few long rows: float8 runs from 1024 tokens, in chunks of as many or more, so it was
    not timed.)
    With pass 2 walking back (`walks_back`), both passes in one at 256-2048 rows of 128256 and
    256000 columns ran 2-12% faster on 16384 and 16 than on the rule before (4096/8 above 512
    rows, 32768/32 up to 512), and 2-5% slower than 32768/32 at 16-64 rows
    (benchmarks/rows_kernel_tuning_512_4096_h200.md, benchmarks/rows_kernel_tuning_16_2048_h200.md;
    in the whole memory-lean loss the gain is within the timing's spread: docs/performance.md)."""
    if kind == "full" and 256 <= C <= 2048 and V > 40960:
        default_block, default_warps = _SOME_LONG_ROWS_FULL
    elif C <= 512 and V > 40960:
        default_block, default_warps = _FEW_LONG_ROWS[kind]
    elif kind == "stats":
        default_block, default_warps = 4096, 4
    elif kind == "grad":
        default_block, default_warps = 4096, 16
    elif kind == "full+e4m3":
        default_block, default_warps = 2048, 8
    elif V <= 40960:
        default_block, default_warps = 8192, 16
    else:
        default_block, default_warps = 4096, 8
    block_v = block_v or min(triton.next_power_of_2(V), default_block)
    return block_v, num_warps or min(default_warps, max(1, block_v // 256))


def walks_back(kind: str) -> bool:
    """Whether pass 2 of a pass of `kind` (`_block_and_warps`) walks each row backwards: where
    both passes run in one kernel without the e4m3 copy (module docstring)."""
    return kind == "full"


def _checked_width(logits, width) -> int:
    """The columns a row pass may touch (`launch_rows`): V, or a given width within the rows."""
    V = logits.shape[1]
    if width is None:
        return V
    if logits.stride(1) != 1 or not V <= width <= logits.stride(0):
        raise ValueError(f"width={width}: must be in [V={V}, the row stride "
                         f"{logits.stride(0)}] of contiguous rows")
    return width


def launch_rows(logits, target, loss_out, stats, weight, opts, stats_given, compute_grad,
                block_v=None, num_warps=None, vocab_start=0, vocab_total=None, fp8_grad=None,
                off_max=None, weight_scale=None, reverse_grad=None, width=None):
    """Run `flce_rows_kernel` over a chunk; same contract as `reference.chunk_rows` (and, for a
    vocabulary slice, the gradient pass of `vocab_parallel`). stats: (row max, log sum exp(z -
    max)), [C] fp32 each, written (or read, stats_given), or None. fp8_grad: (g8 [C, V] e4m3,
    g8_scale [C], target_grad [C]) to fill for the float8 dx GEMM, or None. off_max [C] fp32:
    written by a statistics pass (not compute_grad), read by a float8 gradient pass.
    weight_scale: a 0-dim fp32 tensor the gradient weight is multiplied by (the upstream
    gradient times the loss weight without a launch of its own), or None. block_v, num_warps,
    reverse_grad: a configuration to time (`scripts/bench/tune_rows_kernel.py`,
    `scripts/bench/row_order.py`) instead of the tuned one (`_block_and_warps`, `walks_back`).
    width: the columns of each row behind `logits` (>= V, its row stride at most) that the
    kernel may read and overwrite: those past V are padding, left out of the loss and set to 0
    by a gradient pass, as is fp8_grad's copy (its rows must be as wide). Where it is a multiple
    of 16 and V is not, the accesses are vectorized (`flce_rows_kernel`)."""
    C, V = logits.shape
    if C == 0:
        return
    width = _checked_width(logits, width)
    target = target.contiguous()  # the kernels read target[row] (a strided target was misread)
    kind = "full" if compute_grad and not stats_given else "grad" if compute_grad else "stats"
    kind += "+e4m3" if kind == "full" and fp8_grad is not None else ""
    block_v, num_warps = _block_and_warps(C, V, block_v, num_warps, kind)
    reverse_grad = walks_back(kind) if reverse_grad is None else reverse_grad
    g8, g8_scale, target_grad = fp8_grad or (logits, loss_out, loss_out)  # unused when None
    row_max, log_sum = stats or (loss_out, loss_out)  # unused when None
    keep_off_max = off_max is not None and not compute_grad
    assert stats is not None or not stats_given, "a gradient pass reads the row statistics"
    assert not (fp8_grad is not None and stats_given and off_max is None), \
        "a float8 gradient pass after a statistics pass reads the row maxima off the target"
    _launch_rows(
        (C,), logits, logits.stride(0), target, loss_out, row_max, log_sum,
        weight, 0 if weight.dim() == 0 else weight.stride(0),
        weight if weight_scale is None else weight_scale,
        V, width, vocab_start, vocab_total or V, opts.ignore_index, float(opts.logit_scale),
        float(opts.softcap or 1.0), float(opts.label_smoothing), float(opts.z_loss),
        g8, g8.stride(0), g8_scale, target_grad, loss_out if off_max is None else off_max,
        HAS_SOFTCAP=opts.softcap is not None,
        HAS_SMOOTHING=opts.label_smoothing > 0,
        HAS_Z_LOSS=opts.z_loss > 0,
        STATS_GIVEN=stats_given,
        STORE_STATS=stats is not None and not stats_given,
        COMPUTE_GRAD=compute_grad,
        FP8_GRAD=fp8_grad is not None,
        KEEP_OFF_MAX=keep_off_max,
        MAX_OFF_TARGET=fp8_grad is not None or keep_off_max,
        HAS_WEIGHT_SCALE=weight_scale is not None,
        REVERSE_GRAD=reverse_grad,
        PADDED=width > V,
        FP8_MAX=float(torch.finfo(g8.dtype).max) if fp8_grad is not None else 1.0,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )


def launch_row_stats(logits, target, stats_out, opts, vocab_start, block_v=None, num_warps=None,
                     width=None):
    """Per-row (max, sum-exp, target logit, sum z) of a vocabulary slice into stats_out [C, 4].
    width: as launch_rows' (read only here)."""
    C, V = logits.shape
    if C == 0:
        return
    width = _checked_width(logits, width)
    target = target.contiguous()
    block_v, num_warps = _block_and_warps(C, V, block_v, num_warps, "stats")
    _launch_row_stats(
        (C,), logits, logits.stride(0), target, stats_out, V, width, vocab_start,
        opts.ignore_index, float(opts.logit_scale), float(opts.softcap or 1.0),
        HAS_SOFTCAP=opts.softcap is not None, HAS_SMOOTHING=opts.label_smoothing > 0,
        PADDED=width > V, BLOCK_V=block_v, num_warps=num_warps)


@triton.jit
def scale_cast_kernel(src_ptr, dst_ptr, scale_ptr, n, BLOCK: tl.constexpr,
                      IN_PLACE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    scale = tl.load(scale_ptr).to(tl.float32)
    if IN_PLACE:  # times 1 leaves it as it is: no memory traffic (the usual upstream gradient)
        n = tl.where(scale != 1.0, n, 0)
    mask = offs < n
    v = tl.load(src_ptr + offs, mask=mask).to(tl.float32) * scale
    tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=mask)


_launch_scale_cast = Launcher(scale_cast_kernel)


def scale_cast(src, dst, scale):
    """dst = src * scale (a 0-dim tensor), rounded once to dst's dtype; dst may be src (then a
    scale of exactly 1 moves no bytes, decided on the device: no host sync).

    One vectorised pass; PyTorch's mixed-dtype `mul(out=)` ran ~4x slower on an H200."""
    n = src.numel()
    BLOCK = 4096
    _launch_scale_cast((triton.cdiv(n, BLOCK),), src, dst, scale, n, BLOCK=BLOCK,
                       IN_PLACE=dst.data_ptr() == src.data_ptr(), num_warps=8)
    return dst
