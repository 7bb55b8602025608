"""Triton kernels that quantize the float8 GEMMs' operands (x, W and W's columns, read through
W.t()) to float8 with one scale per row, and the saturating division they share with the row
kernel's e4m3 copy of dlogits (`kernels.py`). The PyTorch twins are in `float8.py`."""

import torch
import triton
import triton.language as tl

from flce.launch import Launcher


@triton.jit
def fp8_saturated(q, FP8_MAX: tl.constexpr):
    """q clamped to +-FP8_MAX (NaN kept), ready to round to float8."""
    return tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def fp8_quantized(v, scale, FP8_MAX: tl.constexpr):
    """Rows of v over their scales (0 where a scale is 0), saturated: the float8 values."""
    return fp8_saturated(v * tl.where(scale > 0, 1.0 / scale, 0.0)[:, None], FP8_MAX)


@triton.jit
def quantize_whole_rows_kernel(src_ptr, stride_r, R, K, scale_ptr, dst_ptr, stride_dst,
                               col_max_ptr, FP8_MAX: tl.constexpr, COL_ABSMAX: tl.constexpr,
                               ROWS_PER_PROGRAM: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_K: tl.constexpr):
    """Rows of at most BLOCK_K values, BLOCK_R at a time: each row is read once, and its scale
    (max |row| / FP8_MAX) and float8 values come from the same registers. COL_ABSMAX: also this
    program's max |src| per column into row program_id of col_max ([programs, K]; the caller
    reduces it): the column scales of the transposed operand without a read of their own. (An
    atomic max per column and program instead ran 1.2-11x slower on an H200, by configuration.)"""
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    col_max = tl.zeros([BLOCK_K], dtype=tl.float32)
    first = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM
    for r in range(0, ROWS_PER_PROGRAM, BLOCK_R):
        rows = first + r + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & col_ok[None, :]
        v = tl.load(src_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        a = tl.abs(v)
        scale = tl.math.div_rn(tl.max(a, axis=1), FP8_MAX)
        q = fp8_quantized(v, scale, FP8_MAX)
        tl.store(dst_ptr + rows[:, None] * stride_dst + cols[None, :],
                 q.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows, scale, mask=rows < R)
        if COL_ABSMAX:
            col_max = tl.maximum(col_max, tl.max(a, axis=0))
    if COL_ABSMAX:
        tl.store(col_max_ptr + tl.program_id(0).to(tl.int64) * K + cols, col_max, mask=col_ok)


@triton.jit
def _tile(src_ptr, stride_r, stride_k, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    ptrs = src_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_k
    return rows, cols, mask, tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def row_absmax_kernel(src_ptr, stride_r, stride_k, R, K, absmax_ptr, col_absmax_ptr,
                      COL_ABSMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """absmax[r] = max(absmax[r], max |src[r, tile]|) (and per column, COL_ABSMAX): a 2-D grid,
    so that few long rows (the columns of W, read through W.t()) still spread over the GPU."""
    rows, cols, mask, v = _tile(src_ptr, stride_r, stride_k, R, K, BLOCK_R, BLOCK_K)
    a = tl.abs(v)
    tl.atomic_max(absmax_ptr + rows, tl.max(a, axis=1), mask=rows < R)
    if COL_ABSMAX:
        tl.atomic_max(col_absmax_ptr + cols, tl.max(a, axis=0), mask=cols < K)


@triton.jit
def quantize_rows_kernel(src_ptr, stride_r, stride_k, R, K, scale_ptr, dst_ptr, stride_dst,
                         FP8_MAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """dst[r] = src[r] / scale[r], saturated to +-FP8_MAX and rounded to dst's float8 type."""
    rows, cols, mask, v = _tile(src_ptr, stride_r, stride_k, R, K, BLOCK_R, BLOCK_K)
    q = fp8_quantized(v, tl.load(scale_ptr + rows, mask=rows < R, other=1.0), FP8_MAX)
    tl.store(dst_ptr + rows[:, None].to(tl.int64) * stride_dst + cols[None, :],
             q.to(dst_ptr.dtype.element_ty), mask=mask)


_launch_whole_rows = Launcher(quantize_whole_rows_kernel)
_launch_row_absmax = Launcher(row_absmax_kernel)
_launch_quantize_rows = Launcher(quantize_rows_kernel)
WHOLE_ROW_MAX = 16384  # longest row quantize_rows reads once (held in registers: 64 a thread)
_TILE = 64


def _fp8_max(dst) -> float:
    return float(torch.finfo(dst.dtype).max)


def quantize_rows(src, dst, scale, col_absmax=None):
    """Rowwise float8 quantization of any 2-D view (W.t() included): scale[r] = max |src[r]| /
    the float8 maximum (0 for a zero row), dst[r] = src[r] / scale[r]; with col_absmax ([K]
    fp32) also max |src| per column. Same contract as `float8.quantize_rows_torch`; dst must
    have unit column stride. Rows of contiguous values up to WHOLE_ROW_MAX long (x, and W's
    rows) are read once; others (W.t()) twice, tile by tile: a pass for the maxima, one for
    the values."""
    R, K = src.shape
    if R == 0 or K == 0:
        scale.zero_()
        if col_absmax is not None:
            col_absmax.zero_()
        return
    fp8_max = _fp8_max(dst)
    block_k = triton.next_power_of_2(K)
    if src.stride(1) == 1 and block_k <= WHOLE_ROW_MAX:
        # timed on an H200 at 32768-128256 rows of 2048 and 4096: alone, 8 rows a program and
        # 4 warps (0.21 ms for W at 128256 x 2048, against 0.42 for the two passes); with the
        # column maxima, 64 rows a program on 8 warps, a row at a time (0.31 ms)
        cols = col_absmax is not None
        rows_per_program = 64 if cols else 8
        block_r = 1 if cols else min(rows_per_program, max(1, 8192 // block_k))
        programs = triton.cdiv(R, rows_per_program)
        col_max = src.new_empty(programs, K, dtype=torch.float32) if cols else scale
        _launch_whole_rows((programs,), src, src.stride(0), R, K, scale, dst, dst.stride(0),
                           col_max, FP8_MAX=fp8_max, COL_ABSMAX=cols,
                           ROWS_PER_PROGRAM=rows_per_program, BLOCK_R=block_r, BLOCK_K=block_k,
                           num_warps=8 if cols or block_r * block_k > 8192 else 4)
        if cols:
            torch.amax(col_max, dim=0, out=col_absmax)
        return
    if col_absmax is not None:
        col_absmax.zero_()
    scale.zero_()
    grid = (triton.cdiv(R, _TILE), triton.cdiv(K, _TILE))
    _launch_row_absmax(grid, src, src.stride(0), src.stride(1), R, K, scale,
                       scale if col_absmax is None else col_absmax,
                       COL_ABSMAX=col_absmax is not None, BLOCK_R=_TILE, BLOCK_K=_TILE)
    scale.div_(fp8_max)
    quantize_scaled(src, dst, scale)


def quantize_scaled(src, dst, scale):
    """dst[r] = src[r] / scale[r] (saturated, rounded to dst's float8 type) with the scales
    given: the second pass of `quantize_rows`, or W's columns with the maxima its row pass
    found. Same contract as `float8.quantize_scaled_torch`; dst must have unit column stride."""
    R, K = src.shape
    if R == 0 or K == 0:
        return
    grid = (triton.cdiv(R, _TILE), triton.cdiv(K, _TILE))
    _launch_quantize_rows(grid, src, src.stride(0), src.stride(1), R, K, scale, dst,
                          dst.stride(0), FP8_MAX=_fp8_max(dst), BLOCK_R=_TILE, BLOCK_K=_TILE)
