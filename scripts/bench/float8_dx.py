"""The float8 loss's dx GEMM alone, whole and in row blocks, against the bf16 dx GEMM: which
cuBLAS kernel each runs and how fast, the question behind the float8 dx row blocks.

    python3 -m scripts.bench.float8_dx --shapes 16384x1024x256000,2048x8192x256000 \\
        --rows 1024,2048,4096,8192 --out benchmarks/float8_dx_h100

Each shape is NxHxV: N rows of G (a chunk's, or the one block's tokens). The runs, timed in
interleaved rounds (balanced orders, each visit settled by untimed calls, as `bench.flce --grid`),
on fresh random operands (never zeros):
  bf16          dx = G @ W, bf16 [N, V] @ [V, H] -> bf16, one GEMM
  bf16_loss     the same in the row blocks the bf16 loss runs (`ops.dx_in_row_blocks`: one
                GEMM up to DX_BLOCK_TOKENS rows, else even blocks of at most that many)
  fp8           dx = G @ W as the float8 loss computes it (`flce.float8.scaled_mm`): e4m3 G with
                row scales, e4m3 W (stored transposed, [H, V]) with column scales, bf16 out, no
                fast accumulation (partial sums promoted to fp32 over the K = V terms), one GEMM
  fp8_loss      the same in the row blocks the float8 loss runs (`ops.float8_dx_block_tokens`, a
                `Float8Gemms.dx_into` call each)
  fp8_rows<R>   the same in row blocks of R rows (each R < N of --rows; the last one shorter)
  fp8_fast      one GEMM with fast accumulation, for reference (the loss never runs it: its
                error grows with K)
TFLOP/s count 2·N·H·V. Each run's CUDA kernels (one call, under the profiler) are recorded:
whether cuBLAS picks another kernel for another height (on an H100 it did not: one kernel, whose
speed the height changes).
Writes <out>.json and <out>.md.
"""

import argparse
import sys

if not __package__:
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.float8_dx ...")

import torch  # noqa: E402

from flce.float8 import E4M3, scaled_mm  # noqa: E402
from flce.ops import dx_in_row_blocks, dx_row_blocks, float8_dx_block_tokens  # noqa: E402
from scripts.bench.flce import run_meta  # noqa: E402
from scripts.lib.loss_grid import parse_shape, parse_shapes, parse_sizes  # noqa: E402
from scripts.lib.report import kernel_report_head, provenance, write_report  # noqa: E402
from scripts.lib.timing import interleaved_rounds, medians, require_cuda  # noqa: E402


def dx_runs(N: int, H: int, V: int, rows: list[int]) -> dict:
    """The runs of one shape (V and H padded to multiples of 16, as the float8 loss pads them)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    Vp, Hp = -(-V // 16) * 16, -(-H // 16) * 16
    float8_rows = float8_dx_block_tokens(H)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=bf, generator=gen) * scale

    g16, w16 = rand(N, V, scale=V ** -0.5), rand(V, H, scale=H ** -0.5)
    g8, wt8 = rand(N, Vp, scale=8.0).to(E4M3), rand(Hp, Vp, scale=8.0).to(E4M3)
    g_scale = torch.rand(N, 1, device="cuda", generator=gen) + 0.5
    wt_scale = torch.rand(1, Hp, device="cuda", generator=gen) + 0.5
    dx16, dx8 = torch.empty(N, H, device="cuda", dtype=bf), torch.empty(N, Hp, device="cuda",
                                                                       dtype=bf)

    def fp8(lo: int, hi: int, fast: bool = False):
        scaled_mm(g8[lo:hi], wt8.t(), g_scale[lo:hi], wt_scale, None, fast_accum=fast,
                  out=dx8[lo:hi])

    runs = {"bf16": lambda: torch.mm(g16, w16, out=dx16),
            "bf16_loss": lambda: dx_in_row_blocks(g16, w16),
            "fp8": lambda: fp8(0, N),
            "fp8_loss": lambda: [fp8(lo, hi) for lo, hi in dx_row_blocks(N, float8_rows)]}
    for r in sorted(set(rows)):
        if r < N:
            runs[f"fp8_rows{r}"] = lambda r=r: [fp8(lo, min(lo + r, N)) for lo in range(0, N, r)]
    runs["fp8_fast"] = lambda: fp8(0, N, fast=True)
    return runs


def kernels(fn) -> list[str]:
    """The names of the CUDA kernels one call of fn launches (memsets left out)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                acc_events=True) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith("Memset")})


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [*kernel_report_head(meta, "bfloat16 and float8_e4m3fn"),
             "The dx GEMM alone, in interleaved rounds: ms, TFLOP/s (2·N·H·V) and × the bf16 "
             "loss's dx (bf16_loss); then each run's kernels.", "",
             "| N×H×V | run | ms | TFLOP/s | × bf16_loss |", "|---|---|---|---|---|"]
    for r in results:
        N, H, V = map(int, r["shape"].split("x"))
        for name, ms in r["ms"].items():
            lines.append(f"| {r['shape']} | {name} | {ms:.3f} | {2 * N * H * V / ms / 1e9:.0f} | "
                         f"{ms / r['ms']['bf16_loss']:.3f} |")
    lines += ["", "| N×H×V | run | kernels |", "|---|---|---|"]
    for r in results:
        for name, names in r["kernels"].items():
            lines.append(f"| {r['shape']} | {name} | {' · '.join(f'`{k}`' for k in names)} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.float8_dx", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", required=True, type=lambda s: parse_shapes(s, "NxHxV"),
                   help="comma-separated NxHxV")
    p.add_argument("--rows", default="1024,2048,4096,8192", type=parse_sizes,
                   help="row-block sizes to time (those below N), comma-separated")
    p.add_argument("--seconds", type=float, default=0.3, help="about this long a run a shape")
    p.add_argument("--reps", type=int, default=40, help="at most this many rounds")
    p.add_argument("--out", default="benchmarks/float8_dx", help="output path, no suffix")
    args = p.parse_args()
    require_cuda("scripts.bench.float8_dx")
    meta = {**run_meta(provenance(), "bfloat16"), "seconds_per_run": args.seconds}
    results = []
    for shape in args.shapes:
        N, H, V = parse_shape(shape)
        runs = dx_runs(N, H, V, args.rows)
        rounds = interleaved_rounds(runs, args.seconds, args.reps)
        results.append({"shape": shape, "ms": medians(rounds), "rounds_ms": rounds,
                        "kernels": {name: kernels(fn) for name, fn in runs.items()}})
        del runs
        torch.cuda.empty_cache()
        print(shape, {k: round(v, 3) for k, v in results[-1]["ms"].items()}, flush=True)
        write_report(args.out, {"meta": meta, "results": results}, markdown(meta, results))
    print(markdown(meta, results))


if __name__ == "__main__":
    main()
