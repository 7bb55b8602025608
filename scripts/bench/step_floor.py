#!/usr/bin/env python3
"""The compute-bound floor of one training step: the model's GEMMs, attention, the loss and the
optimizer, each timed alone at the trainer's shapes on one GPU, summed.

A step can be no faster than this sum (everything else — norms, SwiGLU, RoPE, residual adds,
FSDP's casts, gradient clipping — only adds to it), so tokens / sum bounds tokens/s and MFU
before any of that is paid. Given a trainer's measured tokens/s at the same shapes
(--measured), the gap to this bound is what the memory-bound rest of the step costs.

With --float8 tensorwise the blocks' projections are counted as torchao's tensorwise float8
linear layers compute them: three float8 GEMMs each (forward e4m3 x e4m3 with fast accumulation,
dX and dW with the gradient in e5m2), operands already cast and laid out (the casts are part of
the elementwise rest). --loss-float8 sets the fused loss's own float8 option.

    python3 -m scripts.bench.step_floor --flavor llama_1b --batch 8 --seq-len 8192 \\
        --out benchmarks/step_floor_h200
    python3 -m scripts.bench.step_floor --batch 12 --float8 tensorwise --loss-float8 logits+dx \\
        --out benchmarks/step_floor_float8_h200
    python3 -m scripts.bench.step_floor --flavor llama_8b --batch 1 --shards 2 --float8 \\
        tensorwise --loss-float8 logits+dx --out benchmarks/step_floor_8b_float8_h200
"""

import argparse
import sys

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.step_floor ...")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flce  # noqa: E402
from flce.float8 import FLOAT8  # noqa: E402
from components.metrics import peak_flops  # noqa: E402
from models.args import FLAVORS, flops_per_token  # noqa: E402
from models.llama import Llama  # noqa: E402
from scripts.lib.report import provenance, warning_lines, write_report  # noqa: E402
from scripts.lib.timing import median_ms, require_cuda  # noqa: E402

DT = torch.bfloat16


def randn(*shape, scale=1.0, grad=False):
    return (torch.randn(*shape, device="cuda", dtype=DT) * scale).requires_grad_(grad)


def projections_fwd_bwd(tokens, dim, outs):
    """x [tokens, dim] through projections of widths `outs` (as the model: one GEMM each), then
    dX (autograd sums the projections' parts) and every dW."""
    x = randn(tokens, dim, grad=True)
    ws = [randn(n, dim, scale=dim ** -0.5, grad=True) for n in outs]
    dys = [randn(tokens, n) for n in outs]

    def run():
        torch.autograd.grad([F.linear(x, w) for w in ws], [x, *ws], dys)
    return run


def float8_projections_fwd_bwd(tokens, dim, outs):
    """projections_fwd_bwd's GEMMs as torchao's tensorwise Float8Linear runs them: per projection
    y = x @ W.T (e4m3 x e4m3, fast accumulation), dX = dY @ W and dW = dY.T @ X (dY in e5m2).
    _scaled_mm takes its second operand column-major: the layouts are made once, here."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device="cuda")
    x = randn(tokens, dim).to(e4m3)
    x_cm = x.t().contiguous().t()
    gemms = []
    for n in outs:
        w = (randn(n, dim) * 16).to(e4m3)  # [n, dim] row-major: w.t() is column-major
        w_cm = w.t().contiguous().t()
        dy = randn(tokens, n).to(e5m2)
        dy_t = dy.t().contiguous()
        gemms += [(x, w.t(), True), (dy, w_cm, False), (dy_t, x_cm, False)]

    def run():
        for a, b, fast in gemms:
            torch._scaled_mm(a, b, one, one, out_dtype=DT, use_fast_accum=fast)
    return run


def attention_fwd_bwd(batch, n_heads, n_kv_heads, seq_len, head_dim):
    q = randn(batch, n_heads, seq_len, head_dim, grad=True)
    k, v = (randn(batch, n_kv_heads, seq_len, head_dim, grad=True) for _ in range(2))
    dout = randn(batch, n_heads, seq_len, head_dim)

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=n_kv_heads != n_heads)
        torch.autograd.grad(out, (q, k, v), dout)
    return run


def loss_fwd_bwd(tokens, dim, vocab, float8="none"):
    x = randn(tokens, dim, grad=True)
    w = randn(vocab, dim, scale=dim ** -0.5, grad=True)
    t = torch.randint(0, vocab, (tokens,), device="cuda")

    def run():
        torch.autograd.grad(flce.fused_linear_cross_entropy(x, t, w, float8=float8), (x, w))
    return run


def optimizer_step(args, shards=1):
    """One fused AdamW step over fp32 parameters shaped like the model's (gradients given), or
    like one GPU's FSDP shards of them (dim 0 split `shards` ways): its optimizer state."""
    with torch.device("meta"):
        shapes = [p.shape for p in Llama(args, seq_len=16).parameters()]
    params = [torch.randn(-(-s[0] // shards), *s[1:], device="cuda") for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    return opt.step, sum(p.numel() for p in params)


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.step_floor", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="llama_1b", choices=sorted(FLAVORS))
    p.add_argument("--batch", type=int, default=8, help="local batch (sequences)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--float8", choices=("none", "tensorwise"), default="none",
                   help="the projections as torchao's tensorwise float8 linear layers")
    p.add_argument("--loss-float8", choices=FLOAT8, default="none",
                   help="the fused loss's float8 option")
    p.add_argument("--shards", type=int, default=1,
                   help="FSDP shards (GPUs): the optimizer steps 1/shards of the parameters; the "
                        "other parts are per GPU already (its local batch)")
    p.add_argument("--measured", type=float, default=None,
                   help="train.py's tokens/s at these shapes, to report the gap to the bound")
    p.add_argument("--out", default="benchmarks/step_floor_bench",
                   help="output path without suffix")
    args = p.parse_args()
    if args.shards < 1:
        p.error(f"--shards must be at least 1, got {args.shards}")
    require_cuda("scripts.bench.step_floor")
    origin = provenance()  # the commit (a dirty tree flagged) of the code that runs
    torch.manual_seed(0)
    m = FLAVORS[args.flavor]
    tokens = args.batch * args.seq_len
    kv = m.n_kv_heads * m.head_dim
    time = lambda fn: median_ms(fn, warmup=3, reps=args.reps)  # noqa: E731

    parts = {}  # name -> (ms per step, how it is counted)
    for name, n_in, outs in (("wq, wk, wv", m.dim, [m.dim, kv, kv]),
                             ("wo", m.n_heads * m.head_dim, [m.dim]),
                             ("w1, w3", m.dim, [m.ffn_dim, m.ffn_dim]), ("w2", m.ffn_dim, [m.dim])):
        make = float8_projections_fwd_bwd if args.float8 == "tensorwise" else projections_fwd_bwd
        ms = time(make(tokens, n_in, outs))
        parts[name + (" (float8)" if args.float8 != "none" else "")] = (
            m.n_layers * ms, f"{m.n_layers} x {ms:.2f}")
    ms = time(attention_fwd_bwd(args.batch, m.n_heads, m.n_kv_heads, args.seq_len, m.head_dim))
    parts["attention (cuDNN)"] = (m.n_layers * ms, f"{m.n_layers} x {ms:.2f}")
    loss_name = "loss (flce" + (f", float8 {args.loss_float8})" if args.loss_float8 != "none"
                                else ")")
    parts[loss_name] = (time(loss_fwd_bwd(tokens, m.dim, m.vocab_size, args.loss_float8)), "1 x")
    step, n_params = optimizer_step(m, args.shards)
    parts["fused AdamW (fp32)"] = (time(step), f"{n_params / 1e9:.2f}B parameters"
                                   + (f" (1/{args.shards} of the model's)" if args.shards > 1
                                      else ""))

    total = sum(ms for ms, _ in parts.values())
    peak = peak_flops("cuda")
    ceiling = tokens / (total / 1e3)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), **origin, "flavor": args.flavor,
            "batch": args.batch, "seq_len": args.seq_len, "tokens": tokens, "shards": args.shards,
            "float8": args.float8, "loss_float8": args.loss_float8}
    result = {"parts_ms": {k: v[0] for k, v in parts.items()}, "total_ms": total,
              "ceiling_tokens_per_s": ceiling,
              "ceiling_mfu": ceiling * flops_per_token(m, args.seq_len) / peak if peak else None}
    precision = "bf16" + (", float8 projections" if args.float8 != "none" else "")
    lines = [*warning_lines(meta),
             f"GPU: {meta['gpu']} · torch {meta['torch']} · cuDNN {meta['cudnn']} · {precision} · "
             f"{meta['date']} · git {meta['git']}", f"Command: `{meta['command']}`", "",
             f"{args.flavor}, local batch {args.batch} x seq {args.seq_len} = {tokens} tokens a "
             "step" + (f" per GPU, the optimizer over 1/{args.shards} of the parameters (FSDP)"
                       if args.shards > 1 else "")
             + ". Each part timed alone (forward + backward, median ms), summed over the layers.",
             "", "| part | ms per step | share | counted as (ms) |", "|---|---|---|---|"]
    lines += [f"| {k} | {ms:.1f} | {ms / total:.1%} | {how} |" for k, (ms, how) in parts.items()]
    lines += [f"| **sum** | **{total:.1f}** | | |", "",
              f"Ceiling before any elementwise work: {ceiling:,.0f} tokens/s"
              + (f", MFU {result['ceiling_mfu']:.1%} (the bf16 peak, {peak / 1e12:.0f} TFLOP/s, "
                 "also with float8)." if peak else ".")]
    if args.measured:
        step_ms = tokens / args.measured * 1e3
        result.update(measured_tokens_per_s=args.measured, measured_step_ms=step_ms)
        lines += ["", f"Measured by train.py: {args.measured:,.0f} tokens/s = {step_ms:.0f} ms a "
                  f"step, {args.measured / ceiling:.1%} of the ceiling; the other "
                  f"{step_ms - total:.0f} ms are the memory-bound rest (norms, SwiGLU, RoPE, "
                  "casts, clipping)."]
    write_report(args.out, {"meta": meta, "result": result}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
