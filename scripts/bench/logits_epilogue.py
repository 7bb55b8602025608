#!/usr/bin/env python3
"""Could the logits GEMM write the softmax statistics itself, faster than cuBLAS + flce's pass?

Every loss that leaves the GEMMs to cuBLAS reads the logits again for their row statistics (max
and sum of exponentials; docs/performance.md, "The ceiling"). A Triton GEMM could form them in
its epilogue instead, if it runs at cuBLAS's speed. This times, for the logits x @ Wᵀ (bf16):
cuBLAS alone, flce's statistics pass alone, and a persistent Triton TMA GEMM with and without a
statistics epilogue (per row and 128- or 256-column tile: max and sum of exp, combined after)
over a few tile configurations; it checks the Triton logits against cuBLAS's and the
log-sum-exp from the tiles against torch.logsumexp. Writes JSON and a markdown table.

    python3 -m scripts.bench.logits_epilogue --out benchmarks/logits_epilogue_h200
"""

import argparse
import sys

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: "
             "python3 -m scripts.bench.logits_epilogue ...")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flce.kernels import launch_row_stats  # noqa: E402
from flce.options import LossOptions  # noqa: E402
from scripts.lib.loss_grid import parse_shape, parse_shapes  # noqa: E402
from scripts.lib.report import kernel_report_head, provenance, write_report  # noqa: E402
from scripts.lib.timing import median_ms, require_cuda  # noqa: E402

# N x H x V: a chunk of 8192 tokens at the three hidden sizes of the grid, and two one-block shapes
SHAPES = "8192x1024x128256,8192x2048x128256,8192x4096x128256,16384x1024x32000,4096x4096x128256"
# BLOCK_M, BLOCK_N, BLOCK_K, stages, warps (128x256x64 on 4 stages exceeds shared memory)
CONFIGS = [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4),
           (128, 128, 128, 3, 8)]


@triton.jit
def _tile_pid(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % in_group) // size_m


@triton.jit
def logits_kernel(x_desc, w_desc, out_desc, max_ptr, sum_ptr, M, N, K, n_tiles_n,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  NUM_SMS: tl.constexpr, STATS: tl.constexpr, OUT_BF16: tl.constexpr):
    """out = x @ wᵀ (rounded to bf16 where OUT_BF16), persistent over NUM_SMS programs; with
    STATS also each row's max and sum of exp(logit - max) over each BN-column tile, of the
    logits as stored (flce's pass reads them so)."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    tile_out = start - NUM_SMS  # a second counter for the epilogue, as Triton's tutorial 09
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_pid(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            a = x_desc.load([pid_m * BM, ki * BK])
            b = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        tile_out += NUM_SMS
        pid_m, pid_n = _tile_pid(tile_out, num_pid_m, num_pid_n, GROUP_M)
        logits = acc.to(tl.bfloat16) if OUT_BF16 else acc
        out_desc.store([pid_m * BM, pid_n * BN], logits)
        if STATS:
            cols = pid_n * BN + tl.arange(0, BN)
            z = tl.where((cols < N)[None, :], logits.to(tl.float32), -float("inf"))
            row_max = tl.max(z, axis=1)
            row_sum = tl.sum(tl.exp(z - row_max[:, None]), axis=1)
            rows = pid_m * BM + tl.arange(0, BM)
            at = rows.to(tl.int64) * n_tiles_n + pid_n
            tl.store(max_ptr + at, row_max, mask=rows < M)
            tl.store(sum_ptr + at, row_sum, mask=rows < M)


def triton_logits(x, w, config, stats: bool):
    """A call of logits_kernel (x [M, K], w [N, K]) and its outputs (logits, tile max, tile sum)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    BM, BN, BK, stages, warps = config
    (M, K), N = x.shape, w.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    n_tiles_n = triton.cdiv(N, BN)
    tile_max = torch.empty(M, n_tiles_n if stats else 1, device=x.device)
    tile_sum = torch.empty_like(tile_max)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    descs = (TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK]),
             TensorDescriptor.from_tensor(out, [BM, BN]))
    grid = (min(sms, triton.cdiv(M, BM) * n_tiles_n),)

    def run():
        logits_kernel[grid](*descs, tile_max, tile_sum, M, N, K, n_tiles_n, BM=BM, BN=BN, BK=BK,
                            GROUP_M=8, NUM_SMS=sms, STATS=stats,
                            OUT_BF16=x.dtype == torch.bfloat16, num_stages=stages, num_warps=warps)
    return run, (out, tile_max, tile_sum)


def measure(shape: str) -> dict:
    N, H, V = parse_shape(shape)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) * H ** -0.5
    target = torch.randint(0, V, (N,), device="cuda", generator=g)
    logits = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)
    stats = torch.empty(N, 4, device="cuda")
    cublas_ms = median_ms(lambda: torch.mm(x, w.t(), out=logits), reps=20)
    stats_ms = median_ms(lambda: launch_row_stats(logits, target, stats, LossOptions(), 0), reps=20)
    lse = torch.logsumexp(logits.float(), dim=1)
    rec = {"shape": shape, "cublas_ms": cublas_ms, "stats_pass_ms": stats_ms,
           "cublas_tflops": 2 * N * H * V / cublas_ms / 1e9, "triton": []}
    for config in CONFIGS:
        row = {"config": list(config)}
        for stats_on in (False, True):
            try:
                run, (out, tile_max, tile_sum) = triton_logits(x, w, config, stats_on)
                row["stats_ms" if stats_on else "plain_ms"] = median_ms(run, reps=20)
            except triton.runtime.errors.OutOfResources as e:
                row["error"] = str(e).splitlines()[0][:160]
                break
            row["logits_max_abs_diff"] = (out.float() - logits.float()).abs().max().item()
            if stats_on:
                m = tile_max.max(dim=1).values
                tiles_lse = m + torch.log((tile_sum * torch.exp(tile_max - m[:, None])).sum(1))
                row["lse_max_abs_diff"] = (tiles_lse - lse).abs().max().item()
        rec["triton"].append(row)
    done = [r for r in rec["triton"] if "stats_ms" in r]
    rec["best_plain_ms"] = min(r["plain_ms"] for r in done)
    rec["best_stats_ms"] = min(r["stats_ms"] for r in done)
    return rec


def markdown(meta, results) -> str:
    lines = [*kernel_report_head(meta, "bf16"),
             "The logits GEMM x @ Wᵀ (N×H by H×V, bf16 out), median ms. cuBLAS + pass: "
             "torch.mm, then flce's statistics pass over the logits (what flce runs). Triton: a "
             "persistent TMA GEMM, the best of the tile configurations below, alone and with the "
             "row statistics in its epilogue. Ratio: Triton with statistics over cuBLAS + pass "
             "(< 1: the fused epilogue is faster).", "",
             "| N×H×V | cuBLAS | statistics pass | cuBLAS + pass | Triton GEMM | Triton GEMM + "
             "statistics | ratio |", "|---|---|---|---|---|---|---|"]
    for r in results:
        split = r["cublas_ms"] + r["stats_pass_ms"]
        lines.append(f"| {r['shape']} | {r['cublas_ms']:.3f} ({r['cublas_tflops']:.0f} TFLOP/s) | "
                     f"{r['stats_pass_ms']:.3f} | {split:.3f} | {r['best_plain_ms']:.3f} | "
                     f"{r['best_stats_ms']:.3f} | {r['best_stats_ms'] / split:.3f} |")
    lines += ["", "Each configuration (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), ms alone / with "
              "statistics:", "", "| N×H×V | " + " | ".join(
                  "×".join(map(str, c)) for c in CONFIGS) + " |",
              "|---|" + "---|" * len(CONFIGS)]
    for r in results:
        cells = [f"{t['plain_ms']:.3f} / {t['stats_ms']:.3f}" if "stats_ms" in t else "n/a"
                 for t in r["triton"]]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    worst = {key: max(t.get(key, 0) for r in results for t in r["triton"])
             for key in ("logits_max_abs_diff", "lse_max_abs_diff")}
    lines += ["", "Checks: the Triton logits against cuBLAS's, max |diff| "
              f"{worst['logits_max_abs_diff']:.3g}; the log-sum-exp from the tiles against "
              f"torch.logsumexp, max |diff| {worst['lse_max_abs_diff']:.2g}."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.logits_epilogue",
                                description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, type=parse_shapes, help="comma-separated NxHxV")
    p.add_argument("--out", default="benchmarks/logits_epilogue", help="output path, no suffix")
    args = p.parse_args()
    require_cuda("scripts.bench.logits_epilogue")
    origin = provenance()
    results = []
    for shape in args.shapes:
        results.append(measure(shape))
        r = results[-1]
        print(f"{shape}: cuBLAS {r['cublas_ms']:.3f} + pass {r['stats_pass_ms']:.3f} ms; Triton "
              f"{r['best_plain_ms']:.3f}, with statistics {r['best_stats_ms']:.3f}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, **origin}
    text = markdown(meta, results)
    write_report(args.out, {"meta": meta, "results": results}, text)
    print(text, end="")


if __name__ == "__main__":
    main()
