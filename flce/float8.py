"""The `float8` option of the fused loss: its GEMMs in float8 (e4m3) with rowwise scales.

"logits": logits = x_c @ W.T is a float8 GEMM, x scaled per token and W per vocabulary row (a
row's largest |value| maps to 448, e4m3's largest). "logits+dx": dx_c = G @ W too, with G
(dlogits) scaled per token (the row kernel derives the scale from its fp32 statistics and writes
G in e4m3 as it forms it) and W per hidden column (a second, transposed copy). Statistics and
gradient values are still formed in fp32; only the GEMM operands are rounded to e4m3.

The target class's entry of G stays out of the float8 operand and is added exactly, as
G_y * W[y]: while p_y is small, |G_y| ~ 1 would set the row's scale and push the other entries
(~1/V each) into e4m3's subnormal range. The scale then fits the rest of the row.

dW = G.T @ x stays a bf16 GEMM accumulated in fp32. In float8 it would need G scaled per
vocabulary column over the chunk's tokens (a column reduction before G can be written) and
transposed float8 copies of G and x; and rowwise-scaled float8 GEMMs write bf16 only, so the fp32
accumulation over chunks would cost an extra pass over the V x H accumulator per chunk (1.1-1.4x
that GEMM's time on an H200, /work/shared/ANCHORS.md). torchao's `rowwise_with_gw_hp` recipe
keeps this GEMM in high precision for accuracy.

Rowwise float8 GEMMs need the inner and the output-column dimensions to be multiples of 16: the
float8 operands are zero-padded to multiples of 16 (exact: the padding adds zeros) and the logits
buffer gets the padded width, so no shape falls back to bf16. The GEMMs write bf16 (the only
output of rowwise-scaled cuBLAS/CUTLASS); for fp32 or fp16 inputs the logits are converted.
"""

from typing import Optional

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
FLOAT8 = ("none", "logits", "logits+dx")


def padded(n: int) -> int:
    return -(-n // 16) * 16


def zero_padding(t: Tensor, filled_rows: int, filled_cols: Optional[int] = None) -> Tensor:
    """t with its rows from filled_rows (and columns from filled_cols) zeroed: the rest is
    written before every read (zeroing a chunk's dlogits operand was 0.5 ms a call of 63 at
    32768x2048x128256 on an H200)."""
    t[filled_rows:].zero_()
    if filled_cols is not None:
        t[:filled_rows, filled_cols:].zero_()
    return t


def with_zero_rows(t: Tensor, rows: int) -> Tensor:
    """A copy of t with zero rows appended up to `rows`. Not `F.pad`, which fills the whole
    output with zeros before it copies t in: a write of t's size more (on an H200, padding W at
    8192x4096x32001, that fill took 78 microseconds a call, the copy 125)."""
    out = zero_padding(t.new_empty((rows, *t.shape[1:])), t.shape[0])
    out[: t.shape[0]].copy_(t)
    return out


def quantize_rows_torch(src: Tensor, dst: Tensor, scale: Tensor,
                        col_absmax: Optional[Tensor] = None) -> None:
    """The PyTorch twin of `quantize_kernels.quantize_rows`: scale[r] = max |src[r]| / the float8
    maximum (0 for a zero row), dst[r] = src[r] / scale[r] saturated and rounded to float8;
    col_absmax (given): max |src| per column."""
    fp8_max = torch.finfo(dst.dtype).max
    a = src.abs()
    absmax = a.amax(dim=1) if src.shape[1] else src.new_zeros(src.shape[0])
    scale.copy_(absmax.to(torch.float32) / fp8_max)
    if col_absmax is not None:
        col_absmax.copy_(a.amax(dim=0) if src.shape[0] else torch.zeros_like(col_absmax))
    quantize_scaled_torch(src, dst, scale)


def quantize_scaled_torch(src: Tensor, dst: Tensor, scale: Tensor) -> None:
    """The PyTorch twin of `quantize_kernels.quantize_scaled`: dst[r] = src[r] / scale[r] (0
    where the scale is 0), saturated and rounded to float8."""
    fp8_max = torch.finfo(dst.dtype).max
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    dst.copy_((src.to(torch.float32) * inv[:, None]).clamp_(-fp8_max, fp8_max))


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor],
              fast_accum: bool, out: Optional[Tensor] = None) -> Tensor:
    """bf16 (a * scale_a) @ (b * scale_b) (+ bias) of float8 a, b with rowwise scales ([M, 1],
    [1, N]). On the CPU the same product in fp32: torch < 2.12 runs only per-tensor scales there
    (oneDNN), and an fp32 product of the float8 values is what an fp8 GEMM computes."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accum, out=out)
    product = torch.mm(a.float(), b.float()).mul_(scale_a).mul_(scale_b)
    if bias is not None:
        product += bias
    if out is None:
        return product.to(torch.bfloat16)
    return out.copy_(product)


class Float8Gemms:
    """The float8 operands of one sweep of the chunk loop (`ops.chunk_loop`), which calls
    `logits` per chunk and, with dx, per row block of the dx GEMM lets the row kernel fill
    `grad_outputs` before `dx_into`.

    W is quantized once here; each chunk quantizes its rows of x. Padding stays zero."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], target: Tensor, max_rows: int,
                 dx: bool, use_triton: bool, logits: bool = True,
                 w_col_absmax: Optional[Tensor] = None, grad_rows: Optional[int] = None):
        """logits / dx: prepare the operands of that GEMM. W's column scales (the dx operand's)
        come from the pass that quantizes its rows (one read of W for both); the one-block path
        of `ops.py` quantizes the rows in forward, where w_col_absmax ([H] fp32) is filled, and
        the columns in backward, where it is given back (and logits is False). grad_rows: the
        rows of G (one dx row block's; default max_rows)."""
        V, H = weight.shape
        self.V, self.H, self.width, self.dx = V, H, padded(V), dx
        if use_triton:
            from flce.quantize_kernels import quantize_rows, quantize_scaled
            self.quantize, quantize_cols = quantize_rows, quantize_scaled
        else:
            self.quantize, quantize_cols = quantize_rows_torch, quantize_scaled_torch
        fp8 = lambda rows, cols, filled_rows, filled_cols: zero_padding(torch.empty(
            rows, cols, device=weight.device, dtype=E4M3), filled_rows, filled_cols)
        ones32 = lambda *shape: torch.ones(*shape, device=weight.device, dtype=torch.float32)
        if logits:
            if dx and w_col_absmax is None:
                w_col_absmax = weight.new_empty(H, dtype=torch.float32)
            self.w, self.w_scale = fp8(self.width, padded(H), V, H), ones32(1, self.width)
            self.quantize(weight, self.w[:V, :H], self.w_scale[0, :V], w_col_absmax)
            self.x, self.x_scale = fp8(max_rows, padded(H), max_rows, H), ones32(max_rows, 1)
            self.bias = None if bias is None else with_zero_rows(bias.to(torch.bfloat16), self.width)
        if dx:
            assert w_col_absmax is not None, "the dx operand's scales need W's column maxima"
            self.wt, self.wt_scale = fp8(padded(H), self.width, H, V), ones32(1, padded(H))
            torch.div(w_col_absmax, torch.finfo(E4M3).max, out=self.wt_scale[0, :H])
            quantize_cols(weight.t(), self.wt[:H, :V], self.wt_scale[0, :H])
            rows = max_rows if grad_rows is None else grad_rows
            self.g, self.g_scale = fp8(rows, self.width, rows, V), ones32(rows, 1)
            self.target_grad = ones32(rows)
            # W's row per token for dx's exact target term, clamped once a call (ignored rows
            # have G_y = 0): per row block a clamp and a cast were two launches beside its GEMM
            self.target_ids = target.clamp(0, V - 1).to(torch.int32)
            self.dx_block = None  # a row block's float8 dx product where it cannot go to dx

    def logits(self, x_c: Tensor, out: Tensor) -> None:
        """out [rows, width] = x_c @ W.T (+ bias), through bf16; out[:, V:] is padding."""
        n = x_c.shape[0]
        x, x_scale = self.x[:n], self.x_scale[:n]
        self.quantize(x_c, x[:, :self.H], x_scale[:, 0])
        # fast accumulation, as torchao's forward GEMM: K = H terms
        mm = lambda out=None: scaled_mm(x, self.w.t(), x_scale, self.w_scale, self.bias,
                                        fast_accum=True, out=out)
        if out.dtype == torch.bfloat16:
            mm(out=out)
        else:
            out.copy_(mm())

    def grad_outputs(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """(G in e4m3 without the target column, its row scales, G at the target) for n rows."""
        return self.g[:n, :self.V], self.g_scale[:n, 0], self.target_grad[:n]

    def dx_into(self, out: Tensor, weight: Tensor, start: int) -> None:
        """out = G @ W for the rows [start, start + len(out)), whose G the row kernel has just
        put in `grad_outputs` (one row block: `ops.dx_row_blocks`). The GEMM writes a bf16 out
        itself where H needs no padding, else a buffer of the block's rows: no temporary of all
        the rows (the product and W's target rows were 2 GiB of the one block's peak at
        65536x8192x32000)."""
        n = out.shape[0]
        direct = out.dtype == torch.bfloat16 and self.H == self.wt.shape[0]
        if not direct and (self.dx_block is None or self.dx_block.shape[0] < n):
            self.dx_block = out.new_empty(self.g.shape[0], self.wt.shape[0], dtype=torch.bfloat16)
        gw = out if direct else self.dx_block[:n]
        # no fast accumulation: partial sums promoted to fp32 over the K = V terms
        scaled_mm(self.g[:n], self.wt.t(), self.g_scale[:n], self.wt_scale, None,
                  fast_accum=False, out=gw)
        w_y = torch.index_select(weight, 0, self.target_ids[start:start + n])
        torch.addcmul(gw[:, :self.H], w_y, self.target_grad[:n, None], out=out)
