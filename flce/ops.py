"""The two ways the loss sweeps the tokens, and which one a call takes: what runs between the
autograd function (`function.py`, through the custom ops of `custom_ops.py`) and the per-row
math (`kernels.py` on CUDA, `reference.chunk_rows` on the CPU). It holds the choice
(`uses_one_block`, `pick_chunk_size`, `float8_used`), the GEMMs, their vocabulary width and
the fp32 dW accumulation (`gemm_vocab`, `gemm_operands`, `unpadded`, `matmul_into`,
`weight_grad_buffer`, `chunk_loop`), and the two sweeps below.

One block (`block_stats`, `block_grads`): when the logits of all N tokens take no more memory
than the chunked sweep's buffers would, forward writes them once (one GEMM), a row pass forms
each token's loss and softmax statistics, and the logits are kept for backward. Backward turns them into
dlogits in place, scaled by the upstream gradient times the loss weight (so the upstream gradient
is folded in before any rounding, as in the unfused loss), and dx = dlogits @ W, dW = dlogits.T @
x follow, written straight in the parameter dtype: no fp32 accumulator, no cast pass (dW one
GEMM, dx in row blocks of at most 8192 tokens, as in the chunks: `dx_row_blocks`). 6·N·H·V
FLOPs and the memory traffic of the unfused loss under torch.compile.

Chunked (`chunked_pass`): per chunk of tokens, logits = x_c @ W.T (+ b) go into one reused
[C, V] buffer, the row kernel turns them into dlogits in place, and dx_c = dlogits @ W, dW +=
dlogits.T @ x_c, db += sum(dlogits) follow, all during forward (the chunks' logits are not kept).
For reductions "mean" and "sum" that is 6·N·H·V FLOPs, nothing recomputed; backward only
multiplies the stored gradients by the upstream scalar while casting them to the parameter
dtypes (one rounding, as in the unfused loss). For reduction "none" the upstream gradient
differs per token and is unknown in forward, so forward keeps each row's statistics (max and log
sum of exponentials) and backward recomputes each
chunk's logits with the token weights (8·N·H·V FLOPs). dW is accumulated across chunks in fp32
(cuBLAS `out_dtype=float32` on CUDA: no extra pass) and cast to the parameter dtype once. The
memory-lean mode accumulates in the parameter dtype instead and uses small chunks (the memory of
Liger-Kernel, with its bf16 accumulation error).

The loss weight 1/normalizer stays a device tensor: nothing here synchronises with the host.
With `float8` the logits GEMM (and the dx GEMM) run in float8 through `float8.Float8Gemms`.
"""

from typing import Optional

import torch
from torch import Tensor

from flce.float8 import Float8Gemms, padded, with_zero_rows
from flce.options import LossOptions
from flce.reference import chunk_rows

CHUNK_BYTES = 1 << 30       # the logits buffer a chunk aims at ...
MIN_CHUNK_TOKENS = 8192     # ... with at least this many tokens (dW's fp32 accumulation is
MAX_CHUNK_TOKENS = 32768    # a read and a write of V x H per chunk: few chunks keep it cheap)
MAX_CHUNK_BYTES = 4 << 30   # and never more logits than this (8192 tokens up to V = 262144:
# at V = 256000 chunks of 8192 ran 0.5-1.6% faster than 4096 at 7 of 8 points on an H200 and
# an H100, docs/performance.md "Chunk sizes at V = 256000")
# dx = dlogits @ W runs in row blocks of at most this many tokens (both sweeps): on an H100
# (cuBLAS 13) 16384 rows of H = 8192 took 1.07-1.35x two GEMMs of 8192 rows (K = V of 32000,
# 128256, 256000), at H = 4096 1.03-1.04x, while 32768 and 65536 rows ran as fast as blocks of
# 8192 (within 1%): cuBLAS's kernel choice per shape, which 16384-token chunks (V = 32000) met
# too (benchmarks/flce_grad_gemms_*_h100.md, docs/performance.md "The one-block path's dx").
DX_BLOCK_TOKENS = 8192

# The float8 dx GEMM runs in row blocks of its own. Without fast accumulation cuBLAS runs one
# cooperative kernel for it at every height (nvjet ..._coopA_algo2 on an H100), whose speed
# depends on the rows: on an H100 (the dx GEMM alone: benchmarks/float8_dx_h100.md,
# docs/performance.md "Float8 dx row blocks") blocks of 2048 rows (1024 above H = 4096) took
# 0.62-0.93x the time of blocks of 8192 at the nine points with V >= 128256 and more rows than a
# block (16384x8192x128256 31.31 ms against 50.06; 8192x4096x128256 8.08 against 11.10),
# 0.99-1.03x at V = 32000; 1024 rows at H = 1024 ran 1.6x slower, 512 was never the fastest.
# The float8 loss ("logits+dx") ran 6-11% faster at four points, even at the fifth.
FLOAT8_DX_BLOCK_TOKENS = 2048
FLOAT8_DX_WIDE_HIDDEN = 4096
FLOAT8_DX_WIDE_BLOCK_TOKENS = 1024

# float8 GEMMs pay for quantizing W (a read of V x H, per call) and their extra launches only
# from this many tokens and this much GEMM work (N·H·V); measured on an H200 in interleaved
# rounds: at 512 tokens (x4096x256000, x8192x128256) "logits+dx" ran 7-8% slower than bf16,
# at 1024 (x4096x128256, x8192x256000) both modes 7-11% faster; below the work,
# 2048x1024x32000 both slower, 2048x1024x128256 "logits+dx" 3% slower
# (benchmarks/flce_float8_gate_h200.md, flce_float8_threshold_h200.md)
FLOAT8_MIN_TOKENS = 1024
FLOAT8_MIN_WORK = 1 << 38


def pick_chunk_size(n_tokens: int, hidden: int, vocab: int, elem_bytes: int,
                    chunk_size: Optional[int], lean: bool) -> int:
    """Tokens per chunk of the chunked sweep, evened out so that the last chunk is not a sliver.

    Default: about CHUNK_BYTES of logits, within MIN_CHUNK_TOKENS..MAX_CHUNK_TOKENS tokens and at
    most MAX_CHUNK_BYTES (8192 tokens at V = 128256 and 256000, 16384 at V = 32000). Smaller
    chunks make the dW accumulation cost more (each chunk reads and writes the fp32
    accumulator), larger ones cost memory for little speed. Lean: a logits buffer about the size of x,
    next_pow2(N / ceil(V / H)) tokens, as Liger-Kernel."""
    vocab = max(vocab, 1)  # an empty vocabulary slice (vocab-parallel, fewer classes than ranks)
    if chunk_size is None:
        if lean:
            chunk_size = 1 << max(0, (-(-n_tokens // -(-vocab // hidden)) - 1).bit_length())
        else:
            row_bytes = vocab * elem_bytes
            chunk_size = min(MAX_CHUNK_TOKENS, max(MIN_CHUNK_TOKENS, CHUNK_BYTES // row_bytes))
            chunk_size = max(256, min(chunk_size, MAX_CHUNK_BYTES // row_bytes))
    n_chunks = max(1, -(-n_tokens // chunk_size))
    even = -(-n_tokens // n_chunks)
    return max(1, min(chunk_size, -(-even // 8) * 8))


def uses_one_block(n_tokens: int, hidden: int, vocab: int, elem_bytes: int,
                   chunk_size: Optional[int], lean: bool) -> bool:
    """Whether a call with gradients takes the one-block path: when its peak memory (the logits
    of all tokens, then dx and dW in the parameter dtype) is no more than the chunked sweep's
    (one chunk of logits, dx and dW accumulated in fp32, then their casts). A given chunk_size
    smaller than N asks for chunks; memory_lean always chunks. The float8 loss takes the same
    path, at the same peak where H is above a float8 dx row block's rows (docs/loss.md
    "Float8 GEMMs")."""
    if lean:
        return False
    if chunk_size is not None:
        return chunk_size >= n_tokens
    C = pick_chunk_size(n_tokens, hidden, vocab, elem_bytes, None, lean=False)
    if C >= n_tokens:
        return True
    e, acc = elem_bytes, max(4, elem_bytes)
    grads = (n_tokens + vocab) * hidden
    one_block = n_tokens * vocab * e + grads * e
    chunked = C * vocab * e + grads * acc + (grads * e if acc > e else 0)
    return one_block <= chunked


def float8_used(float8: str, n_tokens: int, hidden: int, vocab: int) -> str:
    """The float8 mode a call runs: "none" below FLOAT8_MIN_TOKENS tokens or FLOAT8_MIN_WORK,
    where quantizing W costs more than the float8 GEMMs save (the bf16 GEMMs are then the
    faster and the more exact)."""
    big = n_tokens >= FLOAT8_MIN_TOKENS and n_tokens * hidden * vocab >= FLOAT8_MIN_WORK
    return float8 if big else "none"


def float8_gemms(float8: str, need_dx: bool) -> str:
    """The float8 mode a call's GEMMs run: "logits+dx" without a dx to form runs no dx GEMM,
    so it is "logits" there (the float8 dx operands and GEMM follow this mode)."""
    return "logits" if float8 == "logits+dx" and not need_dx else float8


def _row_fn(use_triton: bool):
    if use_triton:
        from flce.kernels import launch_rows
        return launch_rows
    return chunk_rows


def matmul_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b, with out possibly fp32 while a, b are bf16/fp16."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda:  # cuBLAS writes fp32 straight from its fp32 accumulators
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))
    else:
        torch.mm(a.to(out.dtype), b.to(out.dtype), out=out)


def float8_dx_block_tokens(hidden: int) -> int:
    """The most rows of one float8 dx GEMM (`Float8Gemms.dx_into`) at hidden size H."""
    return FLOAT8_DX_WIDE_BLOCK_TOKENS if hidden > FLOAT8_DX_WIDE_HIDDEN else \
        FLOAT8_DX_BLOCK_TOKENS


def dx_row_blocks(n_rows: int, block_tokens: Optional[int] = None) -> list[tuple[int, int]]:
    """[start, end) of the even row blocks, of at most block_tokens rows (the bf16 dx's
    DX_BLOCK_TOKENS unless given), that a dx GEMM of n_rows runs in (one block up to that
    many)."""
    block_tokens = block_tokens or DX_BLOCK_TOKENS
    if n_rows <= block_tokens:
        return [(0, n_rows)]
    blocks = -(-n_rows // block_tokens)
    even_rows = -(-n_rows // blocks)
    rows = -(-even_rows // 8) * 8
    return [(start, min(start + rows, n_rows)) for start in range(0, n_rows, rows)]


def dx_in_row_blocks(dlogits: Tensor, w: Tensor) -> Tensor:
    """dlogits @ w in `dx_row_blocks`."""
    bounds = dx_row_blocks(dlogits.shape[0])
    if len(bounds) == 1:
        return torch.mm(dlogits, w)
    dx = dlogits.new_empty(dlogits.shape[0], w.shape[1])
    for start, end in bounds:
        torch.mm(dlogits[start:end], w, out=dx[start:end])
    return dx


def gemm_vocab(vocab: int, elem_bytes: int) -> int:
    """The vocabulary width the GEMMs run at: V, or V rounded up to a multiple of 16 where a row
    of V elements is not a whole number of 16-byte words (an odd vocabulary such as GPT-2's
    50257). cuBLAS runs GEMMs with such a dimension about 5x slower (an H200 at 16384x2048x50257:
    the three GEMMs 81 ms against 15 ms at V = 50264), so W gets zero rows up to this width
    (`gemm_operands`) and the logits and dW buffers have it too. The padding's logits are 0,
    never enter the loss, and add nothing to dx; dW's padding rows are dropped."""
    return vocab if vocab * elem_bytes % 16 == 0 else padded(vocab)


def gemm_operands(weight: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """W (and the bias) with zero rows up to `gemm_vocab`: the tensors themselves where V needs
    none, else a copy (a read and a write of V x H: about 100/N of the three GEMMs' time)."""
    V = weight.shape[0]
    width = gemm_vocab(V, weight.element_size())
    if width == V:
        return weight, bias
    return with_zero_rows(weight, width), None if bias is None else with_zero_rows(bias, width)


def unpadded(dw: Optional[Tensor], vocab: int) -> Optional[Tensor]:
    """dW's first `vocab` rows, or dW itself where it has no padding rows (`gemm_vocab`)."""
    return dw if dw is None or dw.shape[0] == vocab else dw[:vocab]


def weight_grad_buffer(weight: Tensor, dtype: torch.dtype, n_tokens: int) -> Tensor:
    """dW's accumulator, `gemm_vocab` rows (the caller keeps the first V): the first chunk
    overwrites it (no memset pass over V x H), unless there is no chunk."""
    make = torch.empty if n_tokens else torch.zeros
    V, H = weight.shape
    return make(gemm_vocab(V, weight.element_size()), H, device=weight.device, dtype=dtype)


def chunk_loop(x: Tensor, weight: Tensor, bias: Optional[Tensor], chunk_size: int, row_pass,
               dx: Optional[Tensor], dw_acc: Optional[Tensor], db_acc: Optional[Tensor],
               fp8: Optional[Float8Gemms] = None) -> None:
    """Per chunk of tokens [start, end): logits = x_c @ W.T (+ b) into one reused buffer;
    row_pass(logits, start, end, width) turns them into dlogits in place (width: the columns
    of the buffer's rows, which it may touch: `kernels.launch_rows`); then dx_c = dlogits @ W
    (in `dx_row_blocks`),
    dW += dlogits.T @ x_c, db += sum(dlogits), into whichever of dx, dw_acc, db_acc is given.
    The GEMMs run at `gemm_vocab` columns (dw_acc has that many rows: `weight_grad_buffer`).
    With fp8 the logits GEMM, and the dx GEMM if fp8.dx, run in float8; a float8 dx's row
    pass runs a row block at a time, each block's dx GEMM after it (its e4m3 G, a block's
    rows, then holds the next block's)."""
    N, V = x.shape[0], weight.shape[0]
    width = gemm_vocab(V, x.element_size())
    buf = torch.empty(min(chunk_size, N), width if fp8 is None else fp8.width,
                      device=x.device, dtype=x.dtype)  # float8 GEMMs write a padded width
    bf16_gemm_reads_w = fp8 is None or (dx is not None and not fp8.dx)  # logits, or dx
    w, b = gemm_operands(weight, bias) if bf16_gemm_reads_w else (weight, bias)
    w_t = w.t()
    # views made once a call, and no slice that changes nothing: at a few thousand tokens each
    # view is host time a chunk beside its three GEMMs (tests/test_flce_host_ops.py)
    trim = buf.shape[1] != width
    float8_dx = dx is not None and fp8 is not None and fp8.dx
    dx_rows = float8_dx_block_tokens(weight.shape[1]) if float8_dx else None
    x_parts = x.split(chunk_size)
    dx_parts = dx.split(chunk_size) if dx is not None and (fp8 is None or not fp8.dx) else None
    # chunk height -> (block, logits, rows, logits.T, dx's row blocks of the logits): the last
    # chunk may be shorter
    views = {}
    for i, x_c in enumerate(x_parts):
        start = i * chunk_size
        end = start + x_c.shape[0]
        if x_c.shape[0] not in views:
            block = buf if x_c.shape[0] == buf.shape[0] else buf[: x_c.shape[0]]
            logits = block[:, :width] if trim else block  # columns V.. hold 0 (W's padding rows)
            rows = logits if width == V else logits[:, :V]
            bounds = dx_row_blocks(x_c.shape[0], dx_rows)
            # the float8 dx runs a row block at a time after the row kernel's pass over those
            # rows (G in e4m3 is a block's rows), the bf16 dx after the pass over the chunk
            dx_blocks = [((rows if float8_dx else logits)[lo:hi], lo, hi) for lo, hi in bounds]
            views[x_c.shape[0]] = block, logits, rows, logits.t(), dx_blocks
        block, logits, rows, logits_t, dx_blocks = views[x_c.shape[0]]
        if fp8 is not None:
            fp8.logits(x_c, out=block)
        elif b is None:
            torch.mm(x_c, w_t, out=logits)
        else:
            torch.addmm(b, x_c, w_t, out=logits)
        if float8_dx:
            for part, lo, hi in dx_blocks:
                row_pass(part, start + lo, start + hi, block.shape[1])
                fp8.dx_into(dx[start + lo:start + hi], weight, start + lo)
        else:
            row_pass(rows, start, end, block.shape[1])
            if dx is not None and len(dx_blocks) == 1:
                matmul_into(dx_parts[i], logits, w, accumulate=False)
            elif dx is not None:
                for part, lo, hi in dx_blocks:
                    matmul_into(dx_parts[i][lo:hi], part, w, accumulate=False)
        if dw_acc is not None:
            matmul_into(dw_acc, logits_t, x_c, accumulate=start > 0)
        if db_acc is not None:
            db_acc.add_(rows.sum(0, dtype=db_acc.dtype))


def chunked_pass(x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
                 row_weight: Tensor, stats: Optional[tuple[Tensor, Tensor]], stats_given: bool,
                 opts: LossOptions,
                 chunk_size: Optional[int], lean: bool, use_triton: bool,
                 need_dx: bool, need_dw: bool, need_db: bool, cast_grads: bool,
                 float8: str = "none"):
    """One sweep over the tokens. Returns (per-token loss, dx, dW, db); unneeded grads are None.

    With cast_grads the gradients come back in the dtypes of x, weight and bias. Without, they
    stay in their accumulators (fp32, or the parameter dtypes when lean) so that a later
    upstream-gradient multiply rounds to the parameter dtype only once.

    row_weight: fp32, 0-dim (one weight for every token) or [N]; it scales the gradients only.
    stats: (row max, log sum exp(z - max)), [N] fp32 each (float64 for float64 inputs), read
    when stats_given, else written; None when the caller does not need them.
    float8: "none", "logits" or "logits+dx", the GEMMs that run in float8 (`float8.py`).
    """
    N, H = x.shape
    V = weight.shape[0]
    rows = _row_fn(use_triton)
    compute_grad = need_dx or need_dw or need_db
    stat_dtype = torch.promote_types(x.dtype, torch.float32)
    accum_dtype = weight.dtype if lean else torch.promote_types(torch.float32, weight.dtype)
    loss = torch.empty(N, device=x.device, dtype=stat_dtype)
    dx_dtype = x.dtype if cast_grads or lean else stat_dtype
    dx = torch.empty(N, H, device=x.device, dtype=dx_dtype) if need_dx else None
    dw_acc = weight_grad_buffer(weight, accum_dtype, N) if need_dw else None
    db_acc = torch.zeros(V, device=x.device, dtype=stat_dtype) if need_db else None

    C = pick_chunk_size(N, H, V, x.element_size(), chunk_size, lean)
    fp8 = None
    if float8 != "none":
        fp8_dx = float8_gemms(float8, need_dx) == "logits+dx"
        fp8 = Float8Gemms(weight, bias, target, min(C, N), fp8_dx, use_triton,
                          grad_rows=min(C, N, float8_dx_block_tokens(H)) if fp8_dx else None)
        if fp8.dx and stats_given:  # the float8 scales need the max off the target: recompute
            stats, stats_given = None, False

    # each chunk's rows of the per-token tensors, split once (`chunk_loop`'s views)
    per_token = [target, loss, *(stats or ()), *([row_weight] if row_weight.dim() else [])]
    chunks = list(zip(*(t.split(C) for t in per_token)))

    def row_pass(logits, start, end, width):
        i, lo = divmod(start, C)
        per_token_c = chunks[i]
        if end - start != per_token_c[0].shape[0]:  # a float8 dx's row block of the chunk
            per_token_c = [t[lo:lo + end - start] for t in per_token_c]
        target_c, loss_c, *rest = per_token_c
        stats_c = None if stats is None else (rest[0], rest[1])
        rw = row_weight if row_weight.dim() == 0 else rest[-1]
        rows(logits, target_c, loss_c, stats_c, rw, opts, stats_given, compute_grad,
             fp8_grad=fp8.grad_outputs(end - start) if fp8 is not None and fp8.dx else None,
             width=width)

    chunk_loop(x, weight, bias, C, row_pass, dx, dw_acc, db_acc, fp8)
    dw_acc = unpadded(dw_acc, V)
    if not cast_grads:
        return loss, dx, dw_acc, db_acc
    dw = None if dw_acc is None else dw_acc.to(weight.dtype)
    del dw_acc
    db = None if db_acc is None else db_acc.to(bias.dtype)
    return loss, dx, dw, db


def block_stats(x: Tensor, target: Tensor, weight: Tensor, bias: Optional[Tensor],
                opts: LossOptions, use_triton: bool, float8: str, keep_off_max: bool):
    """Forward of the one-block path: (per-token loss, row max, log sum exp(z - max), the logits
    of all tokens, each row's largest logit off the target or None, W's largest |value| per
    column or None). The logits are kept for `block_grads`, `gemm_vocab` columns wide (with
    float8 the float8 GEMM's padded width); columns V.. are padding, 0. keep_off_max: the
    float8 dx GEMM will need the row maxima off the target and W's column maxima (its
    operands' scales)."""
    N, (V, H) = x.shape[0], weight.shape
    stat_dtype = torch.promote_types(x.dtype, torch.float32)
    loss, row_max, log_sum = (torch.empty(N, device=x.device, dtype=stat_dtype) for _ in range(3))
    off_max = torch.empty(N, device=x.device, dtype=stat_dtype) if keep_off_max else None
    w_col_absmax = None
    if float8 != "none":
        if keep_off_max:
            w_col_absmax = torch.empty(H, device=x.device, dtype=torch.float32)
        fp8 = Float8Gemms(weight, bias, target, N, dx=False, use_triton=use_triton,
                          w_col_absmax=w_col_absmax)
        logits = torch.empty(N, fp8.width, device=x.device, dtype=x.dtype)
        if N:
            fp8.logits(x, out=logits)
    else:
        w, b = gemm_operands(weight, bias)
        logits = torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())
    # no gradient in this pass: the row weight (here loss, for a tensor) is not read
    _row_fn(use_triton)(logits[:, :V], target, loss, (row_max, log_sum), loss, opts, False,
                        False, off_max=off_max, width=logits.shape[1])
    return loss, row_max, log_sum, logits, off_max, w_col_absmax


def block_grads(logits: Tensor, row_weight: Tensor, row_scale: Optional[Tensor], x: Tensor,
                target: Tensor, weight: Tensor, bias: Optional[Tensor],
                stats: tuple[Tensor, Tensor], off_max: Optional[Tensor],
                w_col_absmax: Optional[Tensor], opts: LossOptions, use_triton: bool,
                float8: str, need_dx: bool, need_dw: bool, need_db: bool, release_stats: bool):
    """Backward of the one-block path: `logits` (from `block_stats`) become row_weight (times
    row_scale) times the loss's gradient in place, then (dx, dW, db), each None where not
    needed, in the dtypes of x, weight and bias. row_weight: fp32, 0-dim or [N] (the upstream
    gradient); row_scale: a 0-dim fp32 tensor (the loss weight) or None, multiplied in by the
    row pass (on the GPU inside the kernel: one launch fewer). With float8 "logits+dx" (and
    off_max and w_col_absmax kept) the dx GEMM runs in float8. release_stats: free the memory
    of `stats` and row_scale once the row pass has read them (they must be this loss's own,
    read by nothing else)."""
    N, V = x.shape[0], weight.shape[0]
    view = logits[:, :V]
    width = gemm_vocab(V, x.element_size())
    gemm_view = view if width == V else logits[:, :width]  # columns V.. hold 0
    row_fn, dx = _row_fn(use_triton), None
    # a gradient pass writes no loss: its loss_out (here the row maxima) is left as it is
    if float8_gemms(float8, need_dx) == "logits+dx":
        # the row pass a dx row block at a time, each block's float8 dx GEMM after it: G in e4m3
        # holds one block's rows (all N rows of it sat beside the bf16 dlogits before)
        bounds = dx_row_blocks(N, float8_dx_block_tokens(weight.shape[1]))
        fp8 = Float8Gemms(weight, None, target, N, dx=True, use_triton=use_triton, logits=False,
                          w_col_absmax=w_col_absmax,
                          grad_rows=max(hi - lo for lo, hi in bounds))
        dx = x.new_empty(x.shape)
        for lo, hi in bounds if N else ():
            row_fn(view[lo:hi], target[lo:hi], stats[0][lo:hi],
                   (stats[0][lo:hi], stats[1][lo:hi]),
                   row_weight if row_weight.dim() == 0 else row_weight[lo:hi], opts, True, True,
                   fp8_grad=fp8.grad_outputs(hi - lo), off_max=off_max[lo:hi],
                   weight_scale=row_scale, width=logits.shape[1])
            fp8.dx_into(dx[lo:hi], weight, lo)
        # G's block and W's transposed copy (H x V bytes) are done with: freed before dW's
        # GEMM, this backward's peak (then the bf16 one block's: 8192x4096x128256, 3070 MiB;
        # 4637 with both and G of all the rows held, docs/loss.md "Float8 GEMMs")
        del fp8
    else:
        row_fn(view, target, stats[0], stats, row_weight, opts, True, True, off_max=off_max,
               weight_scale=row_scale, width=logits.shape[1])
    if release_stats:
        # An autograd Function's saved tensors live until its backward returns, so without this
        # the row statistics (8 bytes a token) would be held through the GEMMs, the backward's
        # peak. The caching allocator orders the reuse after the row pass on this stream.
        for t in (*stats, row_scale):
            if t is not None:
                t.untyped_storage().resize_(0)
    dw = db = None
    if need_dx and dx is None:
        dx = dx_in_row_blocks(gemm_view, gemm_operands(weight, None)[0])
    if need_dw:
        dw = unpadded(torch.mm(gemm_view.t(), x), V)
    if need_db:
        db = view.sum(0, dtype=stats[0].dtype).to(bias.dtype)
    return dx, dw, db
