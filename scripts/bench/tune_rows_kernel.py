"""Time each pass of the row kernel alone on one [C, V] bf16 chunk, per block size and warps.

GB/s count the bytes a pass must move: statistics 1 read (with and without the row maxima off
the target that the float8 dx GEMM needs); gradient after them 1 read + 1 write (and + the e4m3
copy of dlogits, half a write); both passes in one 2 reads + 1 write (the re-read mostly hits L2;
the float8 chunks' kernel, "full+e4m3", adds the e4m3 copy).
A bf16 copy and a bf16 -> e4m3 copy give the memory's rate. Each pass's configurations are timed
in shuffled rounds (`interleaved_ms`, each call settled by a few ms of untimed ones), as the loss
grid is, so that a drift of the GPU's clocks falls on all of them alike: the passes at a few
hundred rows take tenths of a millisecond. flce/kernels.py's `_block_and_warps` holds the result.
    python3 -m scripts.bench.tune_rows_kernel --rows 8192,32768 --vocab 128256
    python3 -m scripts.bench.tune_rows_kernel --rows 16,128,512,2048 --vocab 32000,256000 --passes full
"""

import argparse
import sys

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.tune_rows_kernel ...")

import torch  # noqa: E402

from flce.kernels import launch_rows  # noqa: E402
from flce.options import LossOptions  # noqa: E402
from scripts.lib.timing import interleaved_ms, median_ms  # noqa: E402

CONFIGS = ((None, None), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16),
           (8192, 8), (8192, 16), (8192, 32), (16384, 16), (16384, 32), (32768, 32))


def passes(C, V, opts):
    """{name: (run(block, warps), bytes moved)} over fresh logits of C x V."""
    dev = "cuda"
    logits = torch.randn(C, V, device=dev, dtype=torch.bfloat16) * 3
    work = logits.clone()
    target = torch.randint(0, V, (C,), device=dev)
    loss, scratch, row_max, log_sum, off_max, g8_scale, target_grad = (
        torch.empty(C, device=dev) for _ in range(7))
    g8 = torch.empty(C, V, device=dev, dtype=torch.float8_e4m3fn)
    w = torch.full((), 1e-3, device=dev)
    stats = (row_max, log_sum)
    launch_rows(logits, target, loss, stats, w, opts, False, False, off_max=off_max)
    n = logits.numel() * 2
    return {
        "stats": (lambda b, k: launch_rows(logits, target, loss, stats, w, opts, False, False,
                                           b, k), n),
        "stats+off_max": (lambda b, k: launch_rows(logits, target, loss, stats, w, opts, False,
                                                   False, b, k, off_max=off_max), n),
        "grad": (lambda b, k: launch_rows(work, target, scratch, stats, w, opts, True, True,
                                          b, k), 2 * n),
        "grad+e4m3": (lambda b, k: launch_rows(work, target, scratch, stats, w, opts, True, True,
                                               b, k, fp8_grad=(g8, g8_scale, target_grad),
                                               off_max=off_max), 2.5 * n),
        "full": (lambda b, k: launch_rows(work, target, loss, None, w, opts, False, True, b, k),
                 3 * n),
        "full+e4m3": (lambda b, k: launch_rows(work, target, loss, None, w, opts, False, True,
                                               b, k, fp8_grad=(g8, g8_scale, target_grad)),
                      3.5 * n),
    }, lambda: work.copy_(logits), lambda: g8.copy_(logits), n


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.tune_rows_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8192,32768", help="comma-separated chunk heights")
    p.add_argument("--vocab", default="32000,128256", help="comma-separated vocabulary sizes")
    p.add_argument("--smoothing", action="store_true", help="with label smoothing and softcap")
    p.add_argument("--passes", default="", help="comma-separated pass names (default: all): "
                   "stats, stats+off_max, grad, grad+e4m3, full, full+e4m3")
    p.add_argument("--seconds", type=float, default=0.05, help="timed seconds per configuration")
    p.add_argument("--max-reps", type=int, default=30, help="at most this many timed calls each")
    p.add_argument("--settle-ms", type=float, default=5.0,
                   help="untimed calls before each timed one, in ms")
    args = p.parse_args()
    opts = LossOptions(label_smoothing=0.1, softcap=30.0) if args.smoothing else LossOptions()
    kinds = args.passes.split(",") if args.passes else None
    for C in map(int, args.rows.split(",")):
        for V in map(int, args.vocab.split(",")):
            runs, copy, copy_e4m3, n = passes(C, V, opts)
            print(f"== {C} x {V}: bf16 copy {2 * n / median_ms(copy, 3, 20) / 1e6:.0f} GB/s, "
                  f"bf16 -> e4m3 copy {1.5 * n / median_ms(copy_e4m3, 3, 20) / 1e6:.0f} GB/s")
            configs = [(b, k) for b, k in CONFIGS if b is None or b <= 2 * V]
            for name, (run, nbytes) in runs.items():
                if kinds is not None and name not in kinds:
                    continue
                timed = {cfg: (lambda cfg: lambda: run(*cfg))(cfg) for cfg in configs}
                ms = interleaved_ms(timed, args.seconds, args.max_reps, settle_ms=args.settle_ms)
                print(f"  {name}: " + " | ".join(
                    f"{b or 'default'}/{k or 'default'} {ms[(b, k)]:.3f} ms "
                    f"{nbytes / ms[(b, k)] / 1e6:.0f}" for b, k in configs), flush=True)
            del runs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
