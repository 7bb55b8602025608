"""The GPU kernels of each loss at given shapes, from the profiler, kept as a report.

    python3 -m scripts.bench.loss_kernels --shapes 65536x4096x32000 --only flce,flce_lean,liger
    python3 -m scripts.bench.loss_kernels --float8 --shapes 8192x2048x128256

Per shape, the bare GEMMs and each loss of `bench.flce` (`--only` some of them; `--float8`: the
bf16 loss and the float8 ones) run once outside the profiler, then `--calls` times under it.
For each: the summed kernel time per call, its share by kind (GEMMs, the loss's own kernels, the
rest: `bench.summarize_trace`'s kinds), the time of synchronized calls outside the profiler and
whether they went to the driver for memory, the host's time a call with the GPU kept busy (what
the call costs the CPU; where it is near the wall, the GPU waits for the host), and the kernels
that took the most. Where two losses run
the same cuBLAS GEMMs, their kernels side by side say whether the GEMMs or the passes between
them differ; against a timed grid, whether a gap is in the kernels or outside them (launches,
allocations, the GPU's clocks). Writes <out>.json and <out>.md.
"""

import argparse
import statistics
import sys
from collections import defaultdict

if not __package__:
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.loss_kernels ...")

import torch  # noqa: E402

from scripts.bench.flce import fwd_bwd, gemm_floor, make_inputs, methods, run_meta  # noqa: E402
from scripts.bench.summarize_trace import KINDS, kind_of  # noqa: E402
from scripts.lib.loss_grid import parse_shape, parse_shapes  # noqa: E402
from scripts.lib.report import kernel_report_head, provenance, write_report  # noqa: E402
from scripts.lib.timing import ahead_ms, gpu_sleep, median_ms, require_cuda  # noqa: E402

TOP = 6  # kernels listed per run
HOST_TRIALS = 10
HOST_SLEEP_MS = 50.0  # longer than any call's host time


def kernels_per_call(run, calls: int) -> dict:
    """{kernel name: [launches, µs]} per call of run, over `calls` profiled calls."""
    from torch.profiler import ProfilerActivity, profile
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    totals = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += 1 / calls
            totals[event.name][1] += event.device_time / calls
    return dict(totals)


ALLOCATOR_EVENTS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def walls_and_allocations(run, calls: int) -> tuple[float, dict]:
    """The median ms of `calls` synchronized calls of run (CUDA events: the GPU's time from the
    first launch to the last kernel's end, gaps included) and how often the caching allocator
    went to the driver or retried over them (0 in a steady state)."""
    before = torch.cuda.memory_stats()
    wall = median_ms(run, warmup=0, reps=calls)
    after = torch.cuda.memory_stats()
    return wall, {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR_EVENTS}


def host_ms(run, trials: int = HOST_TRIALS) -> float:
    """The median host time of one call of run, in ms, each call made while a sleep kernel
    queued before it keeps the GPU busy (`timing.ahead_ms`): no launch waits for the GPU, and one
    call's launches are far fewer than the queue holds. A call that synchronizes with the GPU
    shows as the sleep's length (tens of ms)."""
    return statistics.median(ahead_ms(run, HOST_SLEEP_MS, gpu_sleep)[1] for _ in range(trials))


def measure_point(shape: str, fns: dict, calls: int) -> list[dict]:
    N, H, V = parse_shape(shape)
    x, t, w = make_inputs(N, H, V, torch.bfloat16)
    floor_run, buffers = gemm_floor(x.detach(), w.detach())
    runs = {"bare_gemms": floor_run, **{name: fwd_bwd(f, x, t, w) for name, f in fns.items()}}
    out = []
    for name, run in runs.items():
        try:
            kernels = kernels_per_call(run, calls)
            wall_ms, allocations = walls_and_allocations(run, calls)
            host = host_ms(run)
        except torch.OutOfMemoryError:
            kernels = wall_ms = allocations = host = None
        x.grad = w.grad = None
        torch.cuda.empty_cache()
        out.append({"shape": shape, "run": name, "calls": calls, "wall_ms": wall_ms,
                    "host_ms": host, "allocator": allocations, "kernels": None if kernels is None
                    else [{"name": k, "launches": n, "us": us} for k, (n, us) in
                          sorted(kernels.items(), key=lambda kv: -kv[1][1])]})
    del x, t, w, runs, floor_run, buffers
    torch.cuda.empty_cache()
    return out


def by_kind(kernels: list[dict]) -> dict:
    """{kind: µs} of a run's kernels, in KINDS' order."""
    shares = {kind: 0.0 for kind, _ in KINDS}
    for k in kernels:
        shares[kind_of(k["name"])] += k["us"]
    return shares


def markdown(meta: dict, results: list[dict]) -> str:
    # reports measured before the host column have no host_ms: they render as they were
    has_host = any("host_ms" in r for r in results)
    lines = [*kernel_report_head(meta, "bfloat16"),
             f"Kernels per call of forward+backward, from the profiler ({results[0]['calls']} "
             "calls after one outside it, if any): their summed time, its parts by kind (GEMMs; "
             "this repository's Triton kernels; the rest: other libraries' Triton and CUDA "
             "kernels, casts, copies) and over the bare GEMMs' sum; then, outside the "
             "profiler, the median of as many synchronized calls timed by CUDA events (wall: "
             "gaps between kernels included) and the caching allocator's trips to the driver "
             "over them (allocations, frees, retries: 0 in a steady state); "
             + (f"the host's time a call (the median of {HOST_TRIALS} calls, each made while a "
                "sleep kernel keeps the GPU busy: near the wall, the GPU waits for the host); "
                if has_host else "")
             + "then the kernels that took the most (µs a call, launches a call).", "",
             "| N×H×V | run | kernels ms | GEMMs ms | flce kernels ms | rest ms | × bare GEMMs | "
             "wall ms | " + ("host ms | " if has_host else "")
             + "driver allocs / frees / retries | largest kernels |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if has_host else "")]
    floor = {r["shape"]: sum(k["us"] for k in r["kernels"]) for r in results
             if r["run"] == "bare_gemms" and r["kernels"]}
    for r in results:
        head = f"| {r['shape']} | {r['run']} | "
        if r["kernels"] is None:
            lines.append(head + "OOM | - | - | - | - | - | - | - |" + (" - |" if has_host else ""))
            continue
        total = sum(k["us"] for k in r["kernels"])
        shares = by_kind(r["kernels"])
        rest = total - shares["GEMM"] - shares["loss (flce kernels)"]
        top = "; ".join(f"{k['name'][:48]} {k['us']:.0f} ({k['launches']:g})"
                        for k in r["kernels"][:TOP])
        vs = f"{total / floor[r['shape']]:.3f}×" if floor.get(r["shape"]) else "-"
        trips = " / ".join(str(r["allocator"][k]) for k in ALLOCATOR_EVENTS)
        lines.append(head + f"{total / 1e3:.2f} | {shares['GEMM'] / 1e3:.2f} | "
                     f"{shares['loss (flce kernels)'] / 1e3:.2f} | {rest / 1e3:.2f} | {vs} | "
                     f"{r['wall_ms']:.2f} | "
                     + (f"{r['host_ms']:.2f} | " if has_host else "")
                     + f"{trips} | {top.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.loss_kernels", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", required=True, type=parse_shapes, help="comma-separated NxHxV")
    p.add_argument("--only", default="", help="comma-separated names of bench.flce's methods")
    p.add_argument("--float8", action="store_true", help="the bf16 loss and the float8 ones")
    p.add_argument("--calls", type=int, default=3, help="profiled calls of each run")
    p.add_argument("--out", default="benchmarks/loss_kernels", help="output path without suffix")
    args = p.parse_args()
    require_cuda("scripts.bench.loss_kernels")
    meta = {**run_meta(provenance(), "bfloat16"), "calls": args.calls}
    results = []
    for shape in args.shapes:
        N, H, V = parse_shape(shape)
        fns = methods(N, H, V, sweep=False, float8=args.float8)
        if args.only:
            fns = {k: f for k, f in fns.items() if k in args.only.split(",")}
        results += measure_point(shape, fns, args.calls)
        write_report(args.out, {"meta": meta, "results": results}, markdown(meta, results))
    print(markdown(meta, results))


if __name__ == "__main__":
    main()
