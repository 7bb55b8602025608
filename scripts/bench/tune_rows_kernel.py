"""Time the row kernel alone on one [C, V] chunk for several block sizes and warp counts.

Reports GB/s counting one read and one write of the chunk (the pass-2 re-read mostly hits L2).
    python3 -m scripts.bench.tune_rows_kernel --rows 4096 --vocab 128256
"""

import argparse
import sys

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.tune_rows_kernel ...")

import torch  # noqa: E402

from flce.kernels import launch_rows  # noqa: E402
from flce.options import LossOptions  # noqa: E402
from scripts.lib.timing import median_ms  # noqa: E402


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.tune_rows_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    args = p.parse_args()
    C, V = args.rows, args.vocab
    logits = torch.randn(C, V, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, V, (C,), device="cuda")
    loss = torch.empty(C, device="cuda")
    w = torch.ones((), device="cuda")
    nbytes = 2 * logits.numel() * logits.element_size()
    for opts in (LossOptions(), LossOptions(label_smoothing=0.1, softcap=30.0)):
        for rows in (256, 1024, C):
            for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 32)):
                src = logits[:rows].clone()
                fn = lambda: launch_rows(src, target[:rows], loss, None, w, opts, False, True,
                                         block, warps)
                ms = median_ms(fn, warmup=5, reps=20)
                print(f"smooth={opts.label_smoothing} softcap={opts.softcap} rows={rows:5d} "
                      f"BLOCK_V={block:5d} warps={warps:2d}: {ms:.3f} ms, "
                      f"{nbytes * rows / C / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
