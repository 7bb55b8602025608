#!/usr/bin/env python3
"""The GPU kernels that took the most time in a Chrome trace from `[profiling] enable_profiling`.

    python3 -m scripts.bench.summarize_trace outputs/llama_1b/profile_traces/step-10/rank-0.json --top 25

Groups kernel events by name (truncated), prints total ms, share of all kernel time, calls and
mean µs. Kernels on different streams overlap, so the shares are of summed kernel time.
"""

import argparse
import json
from collections import defaultdict


def kernel_totals(trace: dict, width: int) -> dict:
    totals = defaultdict(lambda: [0.0, 0])
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            t = totals[ev["name"][:width]]
            t[0] += ev.get("dur", 0.0)
            t[1] += 1
    return totals


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.summarize_trace", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", help="a Chrome trace JSON written by torch.profiler")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--width", type=int, default=90, help="characters of each kernel name kept")
    args = p.parse_args()
    with open(args.trace) as f:
        totals = kernel_totals(json.load(f), args.width)
    if not totals:
        raise SystemExit(f"{args.trace}: no GPU kernel events (was CUDA profiled?)")
    all_us = sum(t[0] for t in totals.values())
    print(f"{'total ms':>9} {'share':>6} {'calls':>6} {'mean us':>9}  kernel  (all kernels: {all_us / 1e3:.1f} ms)")
    for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{us / 1e3:9.2f} {100 * us / all_us:5.1f}% {n:6d} {us / n:9.1f}  {name}")


if __name__ == "__main__":
    main()
