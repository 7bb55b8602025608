"""Time each pass of the row kernel alone on one [C, V] bf16 chunk, per block size, warps and
(for both passes in one kernel) the order of pass 2; keep the result as a report.

GB/s count the bytes a pass must move: statistics 1 read (with and without the row maxima off
the target that the float8 dx GEMM needs); gradient after them 1 read + 1 write (and + the e4m3
copy of dlogits, half a write); both passes in one 2 reads + 1 write (the float8 chunks' kernel,
"full+e4m3", adds the e4m3 copy): a rate above the copy's means part of the re-read came from
L2. Both passes in one run with pass 2 in pass 1's order ("fwd") and backward (last block
first: "rev", the loss's without the e4m3 copy: `flce.kernels.walks_back`) at each size.
A bf16 copy and a bf16 -> e4m3 copy give the memory's rate. Each pass's configurations are timed
in interleaved rounds of balanced orders (`interleaved_ms`, each call settled by a few ms of
untimed ones), as the loss grid is, so that a drift of the GPU's clocks falls on all of them
alike: the passes at a few hundred rows take tenths of a millisecond. flce/kernels.py's
`_block_and_warps` holds the result. Writes <out>.json and <out>.md: per chunk and pass, the
tuned default against the fastest configuration and (both passes in one) the two orders at the
default's size.
    python3 -m scripts.bench.tune_rows_kernel --rows 8192,32768 --vocab 128256
    python3 -m scripts.bench.tune_rows_kernel --rows 16,128,512,2048 --vocab 32000,256000 --passes full
"""

import argparse
import sys

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.tune_rows_kernel ...")

import torch  # noqa: E402

from flce.kernels import _block_and_warps, launch_rows, walks_back  # noqa: E402
from flce.options import LossOptions  # noqa: E402
from scripts.bench.flce import run_meta  # noqa: E402
from scripts.lib.loss_grid import parse_sizes  # noqa: E402
from scripts.lib.report import kernel_report_head, provenance, write_report  # noqa: E402
from scripts.lib.timing import interleaved_ms, median_ms, require_cuda  # noqa: E402

SIZES = ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 8),
         (8192, 16), (8192, 32), (16384, 16), (16384, 32), (32768, 32))
BOTH = ("full", "full+e4m3")  # the passes that run pass 1 and pass 2 in one kernel


def configs(name: str, V: int) -> list[tuple]:
    """(block, warps, reverse) to time: the tuned default (None, None, None) first, then every
    size up to twice the row, in both orders of pass 2 where both passes run in one kernel."""
    orders = (True, False) if name in BOTH else (None,)
    return [(None, None, None)] + [(b, k, r) for b, k in SIZES if b <= 2 * V for r in orders]


def passes(C, V, opts):
    """{name: (run(block, warps, reverse), bytes moved)} over fresh logits of C x V."""
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
    fp8 = (g8, g8_scale, target_grad)
    return {
        "stats": (lambda b, k, r: launch_rows(logits, target, loss, stats, w, opts, False, False,
                                              b, k), n),
        "stats+off_max": (lambda b, k, r: launch_rows(logits, target, loss, stats, w, opts,
                                                      False, False, b, k, off_max=off_max), n),
        "grad": (lambda b, k, r: launch_rows(work, target, scratch, stats, w, opts, True, True,
                                             b, k), 2 * n),
        "grad+e4m3": (lambda b, k, r: launch_rows(work, target, scratch, stats, w, opts, True,
                                                  True, b, k, fp8_grad=fp8, off_max=off_max),
                      2.5 * n),
        "full": (lambda b, k, r: launch_rows(work, target, loss, None, w, opts, False, True, b,
                                             k, reverse_grad=r), 3 * n),
        "full+e4m3": (lambda b, k, r: launch_rows(work, target, loss, None, w, opts, False, True,
                                                  b, k, fp8_grad=fp8, reverse_grad=r),
                      3.5 * n),
    }, lambda: work.copy_(logits), lambda: g8.copy_(logits), n


def tuned(name: str, C: int, V: int) -> tuple:
    """The (block, warps, reverse) launch_rows picks for this pass."""
    kind = name.replace("stats+off_max", "stats").replace("grad+e4m3", "grad")
    block, warps = _block_and_warps(C, V, None, None, kind)
    return block, warps, walks_back(kind) if name in BOTH else None


def label(cfg) -> str:
    block, warps, reverse = cfg
    return f"{block}/{warps}" + {True: " rev", False: " fwd", None: ""}[reverse]


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [*kernel_report_head(meta, "bfloat16"),
             "Each pass of the row kernel alone over one [C, V] chunk: the tuned default "
             "(`flce.kernels._block_and_warps`; fwd: pass 2 in pass 1's order, rev: last block "
             "first) against the fastest block/warps/order timed, ms and GB/s (bytes the pass must move from and to "
             "HBM, the re-read of both passes in one counted); fwd ÷ rev: at the default's size, "
             "pass 2 in pass 1's order over pass 2 walking backwards.", "",
             "| C×V | copy GB/s | pass | default | ms | GB/s | fastest | ms | GB/s | "
             "default ÷ fastest | fwd ÷ rev |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for point in results:
        for p in point["passes"]:
            ms = {tuple(c["config"]): c["ms"] for c in p["configs"]}
            default = tuple(p["default"])
            d_ms = ms[(None, None, None)]
            best = min(ms, key=ms.get)
            best_ms = ms[best]
            forward, backward = (ms.get((*default[:2], r)) for r in (False, True))
            gbs = p["bytes"] / 1e6
            lines.append(
                f"| {point['rows']}x{point['vocab']} | {point['copy_gbs']:.0f} | {p['pass']} | "
                f"{label(default)} | {d_ms:.3f} | {gbs / d_ms:.0f} | "
                f"{label(default if best == (None, None, None) else best)} | {best_ms:.3f} | "
                f"{gbs / best_ms:.0f} | {d_ms / best_ms:.3f} | "
                f"{'-' if None in (forward, backward) else f'{forward / backward:.3f}'} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.tune_rows_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8192,32768", type=parse_sizes,
                   help="comma-separated chunk heights")
    p.add_argument("--vocab", default="32000,128256", type=parse_sizes,
                   help="comma-separated vocabulary sizes")
    p.add_argument("--smoothing", action="store_true", help="with label smoothing and softcap")
    p.add_argument("--passes", default="", help="comma-separated pass names (default: all): "
                   "stats, stats+off_max, grad, grad+e4m3, full, full+e4m3")
    p.add_argument("--seconds", type=float, default=0.05, help="timed seconds per configuration")
    p.add_argument("--max-reps", type=int, default=30, help="at most this many timed calls each")
    p.add_argument("--settle-ms", type=float, default=5.0,
                   help="untimed calls before each timed one, in ms")
    p.add_argument("--out", default="benchmarks/rows_kernel_tuning",
                   help="output path without suffix")
    args = p.parse_args()
    require_cuda("scripts.bench.tune_rows_kernel")
    opts = LossOptions(label_smoothing=0.1, softcap=30.0) if args.smoothing else LossOptions()
    kinds = args.passes.split(",") if args.passes else None
    meta = {**run_meta(provenance(), "bfloat16"), "smoothing_and_softcap": args.smoothing,
            "seconds_per_config": args.seconds}
    results = []
    for C in args.rows:
        for V in args.vocab:
            runs, copy, copy_e4m3, n = passes(C, V, opts)
            point = {"rows": C, "vocab": V, "copy_gbs": 2 * n / median_ms(copy, 3, 20) / 1e6,
                     "copy_e4m3_gbs": 1.5 * n / median_ms(copy_e4m3, 3, 20) / 1e6,
                     "passes": []}
            for name, (run, nbytes) in runs.items():
                if kinds is not None and name not in kinds:
                    continue
                cfgs = configs(name, V)
                timed = {cfg: (lambda cfg: lambda: run(*cfg))(cfg) for cfg in cfgs}
                ms = interleaved_ms(timed, args.seconds, args.max_reps, settle_ms=args.settle_ms)
                point["passes"].append({"pass": name, "bytes": nbytes,
                                        "default": tuned(name, C, V),
                                        "configs": [{"config": c, "ms": ms[c]} for c in cfgs]})
            results.append(point)
            write_report(args.out, {"meta": meta, "results": results}, markdown(meta, results))
            del runs
            torch.cuda.empty_cache()
    print(markdown(meta, results))


if __name__ == "__main__":
    main()
