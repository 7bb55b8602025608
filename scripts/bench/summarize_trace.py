#!/usr/bin/env python3
"""The GPU kernels that took the most time in a Chrome trace from `[profiling] enable_profiling`.

    python3 -m scripts.bench.summarize_trace outputs/llama_1b/profile_traces/step-10/rank-0.json --top 25
    python3 -m scripts.bench.summarize_trace TRACE --out benchmarks/profile_llama_1b_1xh200 \
        --trace-command "python3 train.py --config configs/llama_1b.toml ..."

Groups kernel events by name (truncated), prints total ms, share of all kernel time, calls and
mean µs, and the share of each kind of kernel (attention, GEMMs, the loss's own kernels, the
optimizer, collectives, the rest: norms, activations, copies). Kernels on different streams
overlap, so the shares are of summed kernel time; the timeline of the step (`trace_timeline.py`:
busy, communication not hidden, idle, host syncs) says what the step waited on. With --out it
also writes a report (<out>.json and <out>.md) naming the trace, the command that made it
(--trace-command) and the commit.
"""

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.summarize_trace ...")

from scripts.lib.trace_timeline import markdown_lines, timeline  # noqa: E402
from scripts.lib.report import probe_environment, provenance, warning_lines, write_report  # noqa: E402

# The first pattern a kernel's name matches gives its kind (cuDNN's and flash's attention, cuBLAS's
# nvjet/cutlass/xmma GEMMs, this repository's Triton kernels, PyTorch's fused AdamW and foreach
# kernels, NCCL).
KINDS = (("attention", r"sdpa|fmha|flash|attention"),
         ("GEMM", r"nvjet|gemm|cutlass|xmma|cublas"),
         ("loss (flce kernels)", r"flce|weighted_sum_kernel|row_absmax|quantize_rows|scale_cast"),
         ("optimizer and gradient norm", r"multi_tensor_apply|adam|foreach"),
         ("collectives", r"nccl"),
         ("the rest (norms, activations, casts, copies)", r""))


def read_trace(path: str) -> dict:
    """The trace's JSON (gzipped where the name ends in .gz, as torch.profiler may write it),
    or a ValueError naming the file and what is wrong with it."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            trace = json.load(f)
    except OSError as e:  # missing, unreadable, or not gzip
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a complete JSON trace ({e}); was it cut short?") from None
    if not isinstance(trace, dict):
        raise ValueError(f"{path}: not a Chrome trace (a JSON object with traceEvents)")
    return trace


def kernel_totals(trace: dict, width: int) -> dict:
    """{kernel name[:width]: [total µs, calls]}."""
    totals = defaultdict(lambda: [0.0, 0])
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            t = totals[ev["name"][:width]]
            t[0] += ev.get("dur", 0.0)
            t[1] += 1
    return totals


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE))


def summarize(totals: dict, top: int) -> dict:
    all_us = sum(us for us, _ in totals.values())
    kernels = [{"kernel": name, "kind": kind_of(name), "ms": us / 1e3,
                "share": us / all_us, "calls": n, "mean_us": us / n}
               for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    kinds = defaultdict(float)
    for k in kernels:
        kinds[k["kind"]] += k["ms"]
    return {"all_kernels_ms": all_us / 1e3, "top": kernels[:top],
            "kinds": [{"kind": kind, "ms": kinds[kind], "share": kinds[kind] * 1e3 / all_us}
                      for kind, _ in KINDS if kind in kinds]}


def text_table(summary: dict) -> str:
    lines = [f"{'total ms':>9} {'share':>6} {'calls':>6} {'mean us':>9}  kernel  "
             f"(all kernels: {summary['all_kernels_ms']:.1f} ms)"]
    lines += [f"{k['ms']:9.2f} {100 * k['share']:5.1f}% {k['calls']:6d} {k['mean_us']:9.1f}  "
              f"{k['kernel']}" for k in summary["top"]]
    lines += ["", *(f"{100 * k['share']:5.1f}%  {k['ms']:9.2f} ms  {k['kind']}"
                    for k in summary["kinds"]), "", *markdown_lines(summary["timeline"])]
    return "\n".join(lines)


def markdown(meta: dict, summary: dict) -> str:
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731  (kernel names hold template bars)
    lines = [*warning_lines(meta),
             f"GPU: {meta.get('gpu')} · torch {meta.get('torch')} · triton {meta.get('triton')} · "
             f"{meta['date']} · git {meta['git']}",
             f"Trace: `{meta['trace']}`, made by `{meta['trace_command'] or 'not recorded'}`",
             f"Command: `{meta['command']}`", "",
             f"Summed kernel time {summary['all_kernels_ms']:.1f} ms (kernels of different "
             "streams overlap, and the profiler slows the step).", "",
             "| kind | ms | share |", "|---|---|---|",
             *(f"| {k['kind']} | {k['ms']:.2f} | {100 * k['share']:.1f}% |"
               for k in summary["kinds"]), "",
             *markdown_lines(summary["timeline"]), "",
             "| total ms | share | calls | mean µs | kind | kernel |", "|---|---|---|---|---|---|",
             *(f"| {k['ms']:.2f} | {100 * k['share']:.1f}% | {k['calls']} | {k['mean_us']:.1f} | "
               f"{k['kind']} | `{cell(k['kernel'])}` |" for k in summary["top"])]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.summarize_trace", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", help="a Chrome trace JSON written by torch.profiler")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--width", type=int, default=90, help="characters of each kernel name kept")
    p.add_argument("--out", default=None, help="also write <out>.json and <out>.md")
    p.add_argument("--trace-command", default="",
                   help="the command that wrote the trace, recorded in the report")
    args = p.parse_args()
    try:
        trace = read_trace(args.trace)
    except ValueError as e:
        p.error(str(e))
    totals = kernel_totals(trace, args.width)
    if not totals:
        raise SystemExit(f"{args.trace}: no GPU kernel events (was CUDA profiled?)")
    summary = {**summarize(totals, args.top), "timeline": timeline(trace)}
    print(text_table(summary))
    if args.out:
        meta = {**provenance(), **probe_environment(), "trace": args.trace,
                "trace_command": args.trace_command}
        write_report(args.out, {"meta": meta, **summary}, markdown(meta, summary))


if __name__ == "__main__":
    main()
