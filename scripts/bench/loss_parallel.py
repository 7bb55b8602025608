#!/usr/bin/env python3
"""Sequence- vs vocab-parallel fused loss under tensor parallelism: which is faster where.

    torchrun --nproc_per_node 2 -m scripts.bench.loss_parallel --out benchmarks/loss_parallel_2xh200

Every process is one TP rank. For each global shape N×H×V (tokens × hidden × vocabulary, bf16 on
CUDA) it times forward+backward of the loss alone (median over --reps, the slowest rank) and
records each rank's peak extra memory, for the two `[loss] parallel` modes:

  sequence  x sharded on the sequence, W replicated: each rank runs the loss on N/TP tokens
            with the whole W; dW is then summed over the ranks (an all-reduce of V×H), which is
            inside the timing because training needs it too.
  vocab     W sharded on the vocabulary: x is all-gathered (N×H), each rank runs its V/TP slice
            with two small all-reduces per chunk, and dx is reduce-scattered; dW stays local.
  vocab_unfused  (with --modes) the unfused vocab-parallel baseline: the [N, V/TP] logit slice
            materialised in fp32, gradients by autograd.

Both do the same 6·N·H·V/TP FLOPs per rank; they differ in what crosses the links (V×H against
N×H, roughly) and in memory (sequence mode holds the whole W and its gradient on every rank).
The loss values of the two modes are printed side by side as a check. On the CPU (gloo, fp32)
it runs too, for tests; its timings mean nothing. Writes JSON and a markdown table (rank 0).
"""

import argparse
import os
import sys

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: "
             "torchrun --nproc_per_node <TP> -m scripts.bench.loss_parallel ...")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard,  # noqa: E402
                                      distribute_tensor)
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

import flce  # noqa: E402
from flce.parallel import LinearLossParallel, VocabParallelLinearLoss  # noqa: E402
from components.process import exit_without_teardown  # noqa: E402
from scripts.lib.loss_grid import parse_shape, parse_shapes  # noqa: E402
from scripts.lib.report import provenance, warning_lines, write_report  # noqa: E402
from scripts.lib.timing import median_ms  # noqa: E402

SHAPES = "8192x2048x128256,32768x2048x128256,16384x4096x128256,32768x4096x128256"
MiB = 1 << 20


def make_step(mode: str, mesh, x, w, target):
    """One forward+backward of the loss in `mode`, ending with gradients in their final
    placement; returns (step function, loss tensor holder)."""
    style = (LinearLossParallel() if mode == "sequence"
             else VocabParallelLinearLoss(fused=mode == "vocab"))
    loss_fn = parallelize_module(flce.FusedLinearCrossEntropyLoss(), mesh, style)
    xd = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Replicate()] if mode == "sequence" else [Shard(0)])
    wd.requires_grad_()
    out = {}

    def step():
        xd.grad = wd.grad = None
        loss = loss_fn(xd, target, wd)
        loss.backward()
        if isinstance(wd.grad, DTensor) and any(isinstance(p, Partial) for p in wd.grad.placements):
            wd.grad = wd.grad.redistribute(mesh, [Replicate()])  # the all-reduce training needs
        out["loss"] = loss
    return step, out


def bench_shape(N, H, V, args, mesh, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)  # the same global tensors on every rank
    x = torch.randn(1, N, H, device=device, dtype=dtype, generator=g)
    w = torch.randn(V, H, device=device, dtype=dtype, generator=g) / H ** 0.5
    target = torch.randint(0, V, (1, N), device=device, generator=g)
    target[torch.rand(1, N, device=device, generator=g) < 0.1] = -100
    cuda = device.type == "cuda"
    rows = []
    for mode in args.modes:
        step, out = make_step(mode, mesh, x, w, target)
        # the ranks start each timed step together (a barrier, outside the timing)
        ms = median_ms(step, args.warmup, args.reps, cuda=cuda, before_each=dist.barrier)
        extra = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / MiB
        stats = torch.tensor([ms, extra or 0.0], device=device,
                             dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        rows.append({"shape": f"{N}x{H}x{V}", "mode": mode, "ms": stats[0].item(),
                     "peak_extra_mib": stats[1].item() if cuda else None,
                     "loss": out["loss"].float().item(),
                     "tflops_per_rank": 6 * N * H * V / mesh.size() / stats[0].item() / 1e9})
        del step, out
        if cuda:
            torch.cuda.empty_cache()
    return rows


def markdown(meta, rows) -> str:
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cell = {(r["shape"], r["mode"]): r for r in rows}
    lines = [*warning_lines(meta),
             f"GPU: {meta['gpu']} ×{meta['tp']} (TP={meta['tp']}) · torch {meta['torch']} · "
             f"{meta['dtype']} · {meta['date']} · git {meta['git']}",
             f"Command: `{meta['command']}`", "",
             "Loss forward+backward incl. the gradient collectives, median ms of the slowest rank / "
             "peak extra MiB per rank (TFLOP/s per rank; loss value as a cross-check).", "",
             "| N×H×V | " + " | ".join(modes) + " | faster |", "|---|" + "---|" * (len(modes) + 1)]
    for s in shapes:
        cells = []
        for m in modes:
            r = cell[(s, m)]
            mem = "" if r["peak_extra_mib"] is None else f" / {r['peak_extra_mib']:.0f}"
            cells.append(f"{r['ms']:.2f}{mem} ({r['tflops_per_rank']:.0f}; loss {r['loss']:.4f})")
        best = min(modes, key=lambda m: cell[(s, m)]["ms"])
        others = [cell[(s, m)]["ms"] for m in modes if m != best]
        ratio = f" ({min(others) / cell[(s, best)]['ms']:.2f}×)" if others else ""
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {best}{ratio} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node <TP> -m scripts.bench.loss_parallel", description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, type=parse_shapes,
                   help="comma-separated global NxHxV")
    p.add_argument("--modes", default="sequence,vocab", help="of sequence, vocab, vocab_unfused")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="benchmarks/loss_parallel_bench", help="path without suffix")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: a GPU per process (NCCL, bf16) where CUDA is present, else gloo "
                        "processes on the CPU (fp32)")
    args = p.parse_args()
    args.modes = args.modes.split(",")
    if "RANK" not in os.environ:
        p.error("run under torchrun: torchrun --nproc_per_node <TP> -m scripts.bench.loss_parallel")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cuda and torch.cuda.device_count() < local_ranks:
        p.error(f"{local_ranks} processes per node but {torch.cuda.device_count()} CUDA devices: "
                "one GPU per process, or --device cpu")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    launcher = ("torchrun", "--nproc_per_node", os.environ.get("WORLD_SIZE", "1"))
    origin = provenance(launcher) if os.environ["RANK"] == "0" else {}  # before the first step
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for shape in args.shapes:
        N, H, V = parse_shape(shape)
        rows += bench_shape(N, H, V, args, mesh, device, dtype)
        if dist.get_rank() == 0:
            for r in rows[-len(args.modes):]:
                print(f"{r['shape']} {r['mode']:9s} {r['ms']:8.2f} ms "
                      f"{r['tflops_per_rank']:5.0f} TFLOP/s/rank loss {r['loss']:.5f}", flush=True)
    if dist.get_rank() == 0:
        meta = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "tp": dist.get_world_size(),
                "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), **origin}
        text = markdown(meta, rows)
        write_report(args.out, {"meta": meta, "results": rows}, text)
        print(text)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # the report is written; see components/process.py
