"""flce at forced chunk sizes, against its own choice: what `flce.ops.pick_chunk_size` and
`uses_one_block` should pick at a shape.

    python3 -m scripts.bench.chunk_sizes --points 16384x1024x128256:4096/8192/16384,...
    python3 -m scripts.bench.chunk_sizes --lean --points 65536x4096x256000:4096/8192
    python3 -m scripts.bench.chunk_sizes --float8 logits+dx --points 16384x8192x256000:8192/16384

Each point is NxHxV:C1/C2/...; a chunk size of N or more is the one-block path. At each point
flce's default (its own choice) and every forced chunk size are timed forward+backward in
interleaved rounds (each visit settled by untimed calls, in balanced orders, as
`bench.flce --grid`), with the bare GEMMs as the floor, and their peak extra memory measured.
--lean also times memory_lean at its own choice and at each forced size: the same chunks with
dx and dW in bf16 (dW accumulated in bf16, the loss weight folded into dlogits), which tells
what flce's fp32 gradients cost apart from its chunk size. --float8 MODE runs every flce (and
memory_lean) call with float8=MODE, and the bf16 loss at its own choice beside them ("bf16");
the floor stays the bare bf16 GEMMs.
Writes <out>.json and <out>.md, after every point (a run cut short keeps what it measured).
"""

import argparse
import sys

if not __package__:
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.chunk_sizes ...")

import torch  # noqa: E402

import flce  # noqa: E402
from scripts.bench.flce import (FLOOR_LOGITS_BYTES, first_calls, flce_path,  # noqa: E402
                                gemm_floor, make_inputs, run_meta, timing_meta)
from scripts.lib.loss_grid import parse_shape, parse_shapes  # noqa: E402
from scripts.lib.report import kernel_report_head, provenance, write_report  # noqa: E402
from scripts.lib.timing import interleaved_rounds, medians, require_cuda  # noqa: E402

POINT = "NxHxV:C1/C2/..."  # e.g. 16384x1024x128256:4096/8192/16384 (`parse_shape`)


def path_name(N: int, H: int, V: int, chunk_size, lean: bool = False) -> str:
    """`bench.flce.flce_path` of this benchmark's bf16 inputs."""
    return flce_path(N, H, V, 2, chunk_size, lean)


def markdown(meta: dict, results: list[dict]) -> str:
    has_lean = any(r.get("memory_lean") for point in results for r in point["runs"])
    lean = ", and memory_lean at each (lean: dx and dW in bf16)" if has_lean else ""
    float8 = meta.get("float8", "none")
    if float8 != "none":
        lean += (f"; every run but bf16 (the bf16 loss at its own choice) with float8 "
                 f"\"{float8}\"")
    lines = [*kernel_report_head(meta, "bfloat16"),
             "flce forward+backward at forced chunk sizes (a size of N or more: the one-block "
             f"path) and at its own choice (default){lean}, in interleaved rounds: ms (× the "
             "bare GEMMs; × the fastest run at the point) / peak extra MiB." +
             (f" Timing: {meta['timing']}." if meta.get("host_ahead") else ""), "",
             "| N×H×V | run | path | ms | × GEMMs | × fastest | MiB |",
             "|---|---|---|---|---|---|---|"]
    for point in results:
        timed = [r["ms"] for r in point["runs"] if r["ms"] is not None]
        for r in point["runs"]:
            head = f"| {point['shape']} | {r['run']} | {r['path']} | "
            if r["ms"] is None:  # out of memory
                lines.append(head + "OOM | - | - | - |")
                continue
            lines.append(head + f"{r['ms']:.2f} | {r['ms'] / point['gemms_ms']:.3f} | "
                         f"{r['ms'] / min(timed):.3f} | {r['extra_mib']:.0f} |")
    return "\n".join(lines) + "\n"


def measure_point(N, H, V, sizes, seconds, reps, lean: bool = False,
                  host_ahead: bool = False, float8: str = "none") -> dict:
    x, t, w = make_inputs(N, H, V, torch.bfloat16)
    floor_run, bufs = gemm_floor(x.detach(), w.detach(), FLOOR_LOGITS_BYTES)
    configs = {"bf16": (None, False, "none")} if float8 != "none" else {}  # (C, lean, float8)
    configs |= {"default": (None, False, float8), **{f"c{c}": (c, False, float8) for c in sizes}}
    if lean:
        configs |= {"lean": (None, True, float8),
                    **{f"c{c}_lean": (c, True, float8) for c in sizes}}
    losses = {name: (lambda x, t, w, c=c, m=m, f=f: flce.fused_linear_cross_entropy(
        x, t, w, chunk_size=c, memory_lean=m, float8=f)) for name, (c, m, f) in configs.items()}
    runs, mib = first_calls(losses, x, t, w)
    rounds = interleaved_rounds({"bare_gemms": floor_run, **runs}, seconds, reps,
                                host_ahead=host_ahead)
    ms = medians(rounds)
    point = {"shape": f"{N}x{H}x{V}", "gemms_ms": ms["bare_gemms"],
             "runs": [{"run": name, "chunk_size": c, "memory_lean": m, "float8": f,
                       "path": path_name(N, H, V, c, m), "ms": ms.get(name),
                       "extra_mib": mib[name], "rounds_ms": rounds.get(name, [])}
                      for name, (c, m, f) in configs.items()]}
    del x, t, w, runs, floor_run, bufs
    torch.cuda.empty_cache()
    return point


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.chunk_sizes", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--points", required=True, type=lambda s: parse_shapes(s, POINT),
                   help="comma-separated NxHxV:C1/C2/...")
    p.add_argument("--seconds", type=float, default=0.5,
                   help="about this long timing each run at each point")
    p.add_argument("--reps", type=int, default=20, help="at most this many rounds")
    p.add_argument("--lean", action="store_true",
                   help="also memory_lean at its own choice and at each forced size")
    p.add_argument("--float8", choices=["none", "logits", "logits+dx"], default="none",
                   help="run flce (and memory_lean) with this float8 mode, the bf16 loss beside")
    p.add_argument("--host-ahead", action="store_true",
                   help="time each call queued behind GEMMs that keep the GPU busy, as in a "
                        "training step whose host runs ahead (`bench.flce --host-ahead`)")
    p.add_argument("--out", default="benchmarks/flce_chunk_sizes",
                   help="output path without suffix")
    args = p.parse_args()
    require_cuda("scripts.bench.chunk_sizes")
    meta = {**run_meta(provenance(), "bfloat16"), "seconds_per_run": args.seconds,
            "float8": args.float8, **timing_meta(args.host_ahead)}
    results = []
    for N, H, V, sizes in (parse_shape(point, POINT) for point in args.points):
        results.append(measure_point(N, H, V, sizes, args.seconds, args.reps, args.lean,
                                     args.host_ahead, args.float8))
        print(" | ".join([results[-1]["shape"]] + [
            f"{r['run']} " + ("OOM" if r["ms"] is None else
                              f"{r['ms']:.2f} ms {r['extra_mib']:.0f} MiB")
            for r in results[-1]["runs"]]), flush=True)
        write_report(args.out, {"meta": meta, "results": results}, markdown(meta, results))
    print(markdown(meta, results))


if __name__ == "__main__":
    main()
