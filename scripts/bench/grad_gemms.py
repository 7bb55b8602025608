"""What the chunked sweep's fp32 gradients cost, GEMM by GEMM: the per-chunk dx and dW GEMMs of
`flce.ops.chunk_loop` with bf16 outputs (memory_lean's) and with fp32 ones (flce's), and dW's
fp32 accumulator in the other layout (dW.T = x_c.T @ dlogits, an [H, V] accumulator).

    python3 -m scripts.bench.grad_gemms --chunks 16384x4096x32000,4096x4096x256000

Each chunk shape is CxHxV (C tokens a chunk). The runs, timed in interleaved rounds (balanced
orders, each visit settled by untimed calls, as `bench.flce --grid`):
  logits          x_c @ W.T -> [C, V] bf16 (the same in every variant: the scale)
  dx_bf16/_fp32   dlogits @ W -> [C, H], bf16 or fp32 out
  dw_bf16_acc     dW += dlogits.T @ x_c, a bf16 accumulator (memory_lean)
  dw_fp32_acc     the same into an fp32 accumulator (flce: cuBLAS out_dtype, beta = 1)
  dw_fp32_first   the first chunk's dW: fp32 out, nothing read (beta = 0)
  dwt_fp32_acc    dW.T += x_c.T @ dlogits into an fp32 [H, V] accumulator
Writes <out>.json and <out>.md.
"""

import argparse
import sys

if not __package__:
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.grad_gemms ...")

import torch  # noqa: E402

from scripts.bench.flce import run_meta  # noqa: E402
from scripts.lib.loss_grid import parse_shape, parse_shapes  # noqa: E402
from scripts.lib.report import kernel_report_head, provenance, write_report  # noqa: E402
from scripts.lib.timing import interleaved_rounds, medians, require_cuda  # noqa: E402

F32 = torch.float32


def gemm_runs(C: int, H: int, V: int) -> dict:
    """The runs of one chunk shape, on fresh random bf16 operands (never zeros)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=bf, generator=g)

    x, w, dl = rand(C, H), rand(V, H) * H ** -0.5, rand(C, V) * V ** -0.5
    logits, dx16, dx32 = torch.empty_like(dl), torch.empty(C, H, device="cuda", dtype=bf), \
        torch.empty(C, H, device="cuda", dtype=F32)
    acc16, acc32 = rand(V, H), torch.randn(V, H, device="cuda", dtype=F32, generator=g)
    acc32_t = torch.randn(H, V, device="cuda", dtype=F32, generator=g)
    return {
        "logits": lambda: torch.mm(x, w.t(), out=logits),
        "dx_bf16": lambda: torch.mm(dl, w, out=dx16),
        "dx_fp32": lambda: torch.mm(dl, w, out_dtype=F32, out=dx32),
        "dw_bf16_acc": lambda: acc16.addmm_(dl.t(), x),
        "dw_fp32_acc": lambda: torch.addmm(acc32, dl.t(), x, out_dtype=F32, out=acc32),
        "dw_fp32_first": lambda: torch.mm(dl.t(), x, out_dtype=F32, out=acc32),
        "dwt_fp32_acc": lambda: torch.addmm(acc32_t, x.t(), dl, out_dtype=F32, out=acc32_t),
    }


def markdown(meta: dict, results: list[dict]) -> str:
    names = list(results[0]["ms"]) if results else []
    lines = [*kernel_report_head(meta, "bfloat16"),
             "Each per-chunk GEMM of the chunked sweep alone, in interleaved rounds: ms (and, "
             "for the fp32 variants, × the bf16 one: dx_fp32 × dx_bf16, dW's × dw_bf16_acc). "
             "A 6·C·H·V-FLOP chunk's three GEMMs are logits + dx + dW.", "",
             "| C×H×V | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in results:
        ms = r["ms"]
        cells = []
        for name in names:
            base = ms["dx_bf16"] if name.startswith("dx_") else ms["dw_bf16_acc"]
            ratio = "" if name in ("logits", "dx_bf16", "dw_bf16_acc") else \
                f" ({ms[name] / base:.3f}×)"
            cells.append(f"{ms[name]:.3f}{ratio}")
        lines.append(f"| {r['chunk']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.grad_gemms", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chunks", required=True, type=lambda s: parse_shapes(s, "CxHxV"),
                   help="comma-separated CxHxV")
    p.add_argument("--seconds", type=float, default=0.3, help="about this long a run a shape")
    p.add_argument("--reps", type=int, default=40, help="at most this many rounds")
    p.add_argument("--out", default="benchmarks/flce_grad_gemms", help="output path, no suffix")
    args = p.parse_args()
    require_cuda("scripts.bench.grad_gemms")
    meta = {**run_meta(provenance(), "bfloat16"), "seconds_per_run": args.seconds}
    results = []
    for C, H, V in (parse_shape(chunk, "CxHxV") for chunk in args.chunks):
        runs = gemm_runs(C, H, V)
        rounds = interleaved_rounds(runs, args.seconds, args.reps)
        results.append({"chunk": f"{C}x{H}x{V}", "ms": medians(rounds), "rounds_ms": rounds})
        del runs
        torch.cuda.empty_cache()
        print(results[-1]["chunk"], {k: round(v, 3) for k, v in results[-1]["ms"].items()},
              flush=True)
        write_report(args.out, {"meta": meta, "results": results}, markdown(meta, results))
    print(markdown(meta, results))


if __name__ == "__main__":
    main()
